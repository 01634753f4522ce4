"""Text <-> token ids for one model, and its chat template.

Builds a `tokenizers.Tokenizer` from a GGUF file's metadata (byte-level BPE, and Gemma's
SentencePiece BPE) or loads an HF `tokenizer.json` directory. Knows nothing of the engine, torch or `transformers`; streaming concerns
(partial UTF-8, stop strings) live in detokenizer.py.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import gguf
import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pagedserve.chat_templates import default_chat_template
from pagedserve.models.gguf_header import read_gguf_header

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special (dropped by
# skip_special_tokens), USER_DEFINED ones are plain added tokens (kept, like Qwen's <tool_call>).
_CONTROL, _USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _gpt2_bytes() -> pre_tokenizers.PreTokenizer:
    """ByteLevel splitting with its built-in GPT-2 regex (`'s|'t|...| ?\\p{L}+| ?\\p{N}+|...`)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


_DIGIT_SPLIT_NAMES = ("smollm", "starcoder", "refact")
_QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen")
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")


def _pre_tokenizer_for(
    pre_type: str,
) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None, bool]:
    """(pre-tokenizer, normalizer, ignore_merges) for llama.cpp's `tokenizer.ggml.pre` name.

    Each entry reproduces the model's original tokenizer.json: SmolLM/StarCoder split every digit
    off first; Qwen2 NFC-normalizes and uses its own regex; Llama 3 looks whole words up in the
    vocabulary before merging (ignore_merges). "gpt2", "default" and unknown names get GPT-2's
    regex, the byte-level BPE default (an unknown name also logs a warning).
    """
    if pre_type in _DIGIT_SPLIT_NAMES:
        digits_then_gpt2 = [pre_tokenizers.Digits(individual_digits=True), _gpt2_bytes()]
        return pre_tokenizers.Sequence(digits_then_gpt2), None, False
    if pre_type in _QWEN2_NAMES:
        return _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC(), False
    if pre_type in _LLAMA3_NAMES:
        return _split_then_bytes(_LLAMA3_SPLIT), None, True
    if pre_type not in ("gpt2", "default"):
        logger.warning("unknown tokenizer.ggml.pre %r; using the GPT-2 pre-tokenizer regex", pre_type)
    return _gpt2_bytes(), None, False


_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"
"""SentencePiece's visible space: its vocabularies spell " hello" as "\u2581hello"."""


def _gemma_sentencepiece(tokens: list[str], unk_token: str) -> tuple[HFTokenizer, set[str]]:
    """Gemma's SentencePiece BPE vocabulary (tokenizer.ggml.model "llama") as a `tokenizers` BPE,
    the way transformers' GemmaTokenizer reads the same GGUF; returns it and the vocabulary's
    spellings.

    Spaces become "\u2581" before the lookup and back after, no prefix space; characters
    the vocabulary lacks fall back to their UTF-8 byte tokens (<0x..>). The file stores no merges:
    every split of a token into two tokens is a merge, ranked by the token's position in the file
    (its merge order; Gemma's scores do not follow it), a longer left piece first. Tokens that are
    runs of whitespace with a space are stored with real spaces: they are respelled with
    "\u2581", as the text they must match is.
    """
    spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: token_id for token_id, token in enumerate(spelled)}
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):  # best (earliest) first
        for split in range(len(token) - 1, 0, -1):
            left, right = token[:split], token[split:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token,
                                       fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    # Splits nothing once spaces are spelled out (GemmaTokenizer's, kept for the same output).
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer, set(vocab)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Raise on the first unsafe attribute access instead of yielding an Undefined that prints ''."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} is unsafe")


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template raised: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                 "eos_token"})
"""What the renderer passes itself; template kwargs may not replace them."""


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in the sandbox: the model's, --chat-template's or a request's,
    all untrusted alike. Cached by text (a server renders a handful of templates)."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from e


def _continue_final_message(rendered: str, messages: list[dict]) -> str:
    """`rendered` cut right after the final message's text, so that the model goes on writing
    it (what the template writes to close the turn is dropped)."""
    content = messages[-1].get("content") if messages else None
    final_text = content.strip() if isinstance(content, str) else ""
    if not final_text:
        raise ValueError("continue_final_message needs a final message with text")
    end = rendered.rfind(final_text)
    if end < 0:
        raise ValueError("continue_final_message: the chat template does not render the final "
                         "message's text as it is")
    return rendered[:end + len(final_text)]


class Tokenizer:
    """A model's tokenizer: `encode`/`decode` plus chat-template rendering.

    `add_bos_token` is whatever the post-processor does: `encode(text)` prepends BOS exactly when
    it is True, and never when add_special_tokens=False (use that for rendered chat prompts, whose
    template writes BOS itself).
    """

    def __init__(self, tokenizer: HFTokenizer, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None) -> None:
        self._tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        """Size of the id space; a model's embedding table may be padded past it."""
        self.all_special_ids: frozenset[int] = frozenset(
            token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )
        self.add_bos_token: bool = (bos_token_id is not None
                                    and tokenizer.encode("").ids[:1] == [bos_token_id])

    # ---- construction ----

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> Tokenizer:
        """A GGUF file or an HF tokenizer directory."""
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if os.path.isfile(path):
            return cls.from_gguf(path)
        raise ValueError(f"tokenizer path {os.fspath(path)!r} is neither a file nor a directory")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes, with `tokenizers` alone: byte-level BPE
        (tokenizer.ggml.model "gpt2") or Gemma's SentencePiece BPE ("llama" in a Gemma file).
        A file without a chat template gets the one we ship for its architecture, if any
        (chat_templates/).

        The header is parsed once per file and shared with the model's config and weights
        (models/gguf_header.py).
        """
        header = read_gguf_header(path)

        def meta(key: str, default: Any = None) -> Any:
            return header.get(f"tokenizer.{key}", default)

        architecture = header.get("general.architecture")
        tokenizer_model = meta("ggml.model")
        tokens: list[str] = meta("ggml.tokens")
        pre_type = meta("ggml.pre", "default")
        if tokenizer_model == "gpt2":
            merges = [tuple(merge.split(" ", 1)) for merge in meta("ggml.merges", [])]
            pre_tokenizer, normalizer, ignore_merges = _pre_tokenizer_for(pre_type)
            vocab = {token: token_id for token_id, token in enumerate(tokens)}
            tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges,
                                               ignore_merges=ignore_merges))
            tokenizer.normalizer = normalizer
            tokenizer.pre_tokenizer = pre_tokenizer
            tokenizer.decoder = decoders.ByteLevel()
            spellings = None  # every token is spelled as it is stored
        elif tokenizer_model == "llama" and architecture in _GEMMA_ARCHITECTURES:
            tokenizer, spellings = _gemma_sentencepiece(
                tokens, tokens[meta("ggml.unknown_token_id", 3)])
        else:
            raise ValueError("GGUF tokenizers supported: byte-level BPE (tokenizer.ggml.model "
                             "'gpt2') and Gemma's SentencePiece ('llama' in a gemma file); got "
                             f"{tokenizer_model!r} in a {architecture!r} file")
        # Added tokens are already in the vocabulary at their own ids, so adding them only makes
        # them match whole in text (<|im_start|> -> one id); the id space does not grow.
        typed = list(zip(tokens, meta("ggml.token_type", [])))
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t, kind in typed if kind == _CONTROL])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t, kind in typed if kind == _USER_DEFINED
                              and (spellings is None or t in spellings)])

        bos_id, eos_id = meta("ggml.bos_token_id"), meta("ggml.eos_token_id")
        # Without the flag, follow llama.cpp: Llama 3 vocabularies add BOS, other BPE ones do not.
        add_bos = meta("ggml.add_bos_token", pre_type in _LLAMA3_NAMES) and bos_id is not None
        add_eos = meta("ggml.add_eos_token", False) and eos_id is not None
        if add_bos or add_eos:
            template = [tokens[bos_id]] * add_bos + ["$A"] + [tokens[eos_id]] * add_eos
            special = {tokens[i]: i for i in (bos_id, eos_id) if i is not None}
            tokenizer.post_processor = processors.TemplateProcessing(single=template,
                                                                     special_tokens=list(special.items()))
        chat_template = meta("chat_template") or default_chat_template(architecture)
        return cls(tokenizer, bos_id, eos_id, chat_template)

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json`, with chat template and BOS/EOS from `tokenizer_config.json`.

        The BOS decision stays with tokenizer.json's post-processor, as in HF fast tokenizers.
        """
        tokenizer_file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"{os.fspath(directory)!r} has no tokenizer.json")
        tokenizer = HFTokenizer.from_file(tokenizer_file)
        config: dict[str, Any] = {}
        config_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)

        def token_id(name: str) -> int | None:
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return tokenizer.token_to_id(token) if token else None

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
        jinja_file = os.path.join(directory, "chat_template.jinja")  # where newer transformers saves it
        if chat_template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                chat_template = f.read()
        return cls(tokenizer, token_id("bos_token"), token_id("eos_token"), chat_template)

    # ---- encode / decode ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text always encode as single ids."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary spellings (byte-level, e.g. 'Ġhello'), not text."""
        return [self._tokenizer.id_to_token(token_id) for token_id in ids]

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included (to compare two models' vocabularies)."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def decode_token(self, token_id: int) -> str:
        """One token as text, for logprob display; a partial UTF-8 character shows as U+FFFD."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what llguidance builds its token trie from)."""
        return self._tokenizer.to_str()

    def supports_tools_in_template(self, chat_template: str | None = None) -> bool:
        """Whether the chat template (`chat_template`, else the model's) renders a `tools` list
        itself (Qwen2.5's does; SmolLM2's does not, so the server describes the tools in a
        system message instead)."""
        source = chat_template if chat_template is not None else self.chat_template
        return source is not None and "tools" in source

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokenizer.id_to_token(token_id) or ""

    # ---- chat template ----

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, chat_template: str | None = None,
                            continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Render `messages` (OpenAI-style dicts) into the prompt text.

        `chat_template`: used instead of the model's. `continue_final_message`: end the prompt
        inside the final message (see _continue_final_message). `template_kwargs`: more
        template variables (a request's chat_template_kwargs, e.g. enable_thinking).
        Runs the template in a sandbox: templates are untrusted code from the model file.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError("this model has no chat template; send a completion request instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        template_kwargs = template_kwargs or {}
        reserved = _TEMPLATE_ARGUMENTS.intersection(template_kwargs)
        if reserved:
            raise ValueError(f"chat template kwargs may not set {', '.join(sorted(reserved))}")
        template = compile_chat_template(source)
        try:
            rendered = template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_token_id), eos_token=self._token_text(self.eos_token_id),
                **template_kwargs,
            )
        except TemplateError as e:
            raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e
        return _continue_final_message(rendered, messages) if continue_final_message else rendered
