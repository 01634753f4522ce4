"""One constrained request's grammar state: an llguidance matcher that the scheduler advances
with each accepted token (request.OutputConstraint) and the manager asks for bitmasks."""

from __future__ import annotations

import logging

import llguidance
import numpy as np

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self.num_accepted_tokens = 0

    # ---- request.OutputConstraint ----

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self._matcher.is_stopped():
            return False
        ok = self._matcher.consume_tokens(token_ids)
        if ok:
            self.num_accepted_tokens += len(token_ids)
        else:
            # The mask forbade this token, so this is a bug; the request ends ("stop").
            logger.warning("grammar rejected tokens %s: %s", token_ids, self._matcher.get_error())
        return ok

    @property
    def is_terminated(self) -> bool:
        # is_stopped: complete and allows only EOS, or in an error state (never left again).
        return self._matcher.is_stopped()

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        if self._matcher.is_stopped():
            return 0
        return self._matcher.validate_tokens(token_ids)

    # ---- bitmasks ----

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def fill_bitmask(self, bitmask: np.ndarray, row: int, num_words: int) -> None:
        """Write the allowed next tokens into bitmask[row, :num_words] (the tokenizer's ids)."""
        target = bitmask[row, :num_words]
        assert target.flags["C_CONTIGUOUS"] and bitmask.dtype == np.int32
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, num_words * 4)

    def fill_bitmasks_with_drafts(self, bitmask: np.ndarray, first_row: int, num_words: int,
                                  draft_token_ids: list[int]) -> None:
        """Rows first_row .. first_row + len(drafts): the mask after consuming drafts[:j].

        Drafts are consumed to reach each position's state and rolled back afterwards: the
        scheduler advances the state only over what the rejection sampler accepts. Past a draft
        the grammar forbids, that row's token is rejected for sure, so the rows after it are
        never used; they are left all-allowed so that their softmax stays finite.
        """
        num_consumed = 0
        for j in range(len(draft_token_ids) + 1):
            self.fill_bitmask(bitmask, first_row + j, num_words)
            if j == len(draft_token_ids):
                break
            # Check before consuming: a rejected token would leave the matcher in an error
            # state that no rollback undoes.
            draft = draft_token_ids[j]
            if self._matcher.is_stopped() or self._matcher.validate_tokens([draft]) != 1:
                break
            self._matcher.consume_token(draft)
            num_consumed += 1
        if num_consumed:
            self._matcher.rollback(num_consumed)
