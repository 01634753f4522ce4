"""Streaming one request's output tokens into text.

Owns the two things a per-token decode gets wrong: a UTF-8 character split over several byte-level
tokens (held back until complete, so no U+FFFD is ever streamed), and stop strings (matched across
token boundaries, cut from the text, and never partly streamed). Knows nothing of the scheduler.
"""

from __future__ import annotations

from pagedserve.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output as context: SentencePiece-style decoders drop the
# leading space of the first token they see, and a prompt may end inside a UTF-8 character.
_NUM_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, token batch by token batch.

    Decoding uses the prefix/read offsets method: each update decodes only a short window and
    emits the text past the part already emitted, unless that text ends in U+FFFD.

        ids:  | prompt ctx / emitted | emitted last time | new, not yet emitted |
              ^ (older)              ^ prefix_offset     ^ read_offset          ^ len(ids)

    `spaces_between_special_tokens` is accepted for API parity and ignored: `tokenizers` fast
    decoding never inserts spaces between special tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self.stop = list(stop or [])
        if any(not stop_str for stop_str in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        # A streamed consumer must never see the start of a stop string that may still complete,
        # so the last (longest stop - 1) characters wait. Not needed when stops are output anyway.
        self.stop_buffer_length = 0
        if self.stop and not include_stop_str_in_output:
            self.stop_buffer_length = max(map(len, self.stop)) - 1

        context_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._ids = context_ids  # prompt context, then output ids
        self._num_context_ids = len(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(context_ids)
        self._output_text = ""
        self._num_returned_chars = 0
        self.stop_reason: str | None = None
        """The stop string that ended the text, once one matched."""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context_ids:]

    @property
    def output_text(self) -> str:
        """All complete text so far, cut at the stop string; held-back characters included."""
        return self._output_text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens; return the stop string if one now matches, else None."""
        assert self.stop_reason is None, "update() after a stop string ended the request"
        self._ids.extend(new_token_ids)
        return self._append_text(self._decode_window(finished=False))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: only the part not returned before (delta) or all of it.

        While not finished, the last `stop_buffer_length` characters are withheld. `finished`
        also flushes an incomplete trailing UTF-8 character (as U+FFFD, like `decode` would),
        so the deltas always add up to the full decode.
        """
        if finished and self.stop_reason is None:
            self._append_text(self._decode_window(finished=True))
        text = self._output_text
        end = len(text) if finished else max(len(text) - self.stop_buffer_length, 0)
        if not delta:
            return text[:end]
        start = self._num_returned_chars
        if end <= start:
            return ""
        self._num_returned_chars = end
        return text[start:end]

    def _decode_window(self, finished: bool) -> str:
        """Text of the ids past read_offset, or "" while they end inside a UTF-8 character."""
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not finished):
            return ""  # nothing new (e.g. a skipped special token), or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def _append_text(self, new_text: str) -> str | None:
        """Append and look for a stop string that ends inside `new_text`; cut the text at it."""
        if not new_text:
            return None
        self._output_text += new_text
        text = self._output_text
        match: tuple[int, str] | None = None  # earliest (start index, stop string)
        for stop_str in self.stop:
            # Only a match with at least one new character is new: start the search just before.
            index = text.find(stop_str, max(len(text) - len(new_text) - len(stop_str) + 1, 0))
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop_str)
        if match is None:
            return None
        index, self.stop_reason = match
        if self.include_stop_str_in_output:
            index += len(self.stop_reason)
        self._output_text = text[:index]
        return self.stop_reason
