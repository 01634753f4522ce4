"""Prompt-lookup (n-gram) proposer: find the context's last n tokens earlier in the context and
propose the tokens that followed them there. CPU only, on token ids; no model.

Its draft distribution is a point mass on each proposed token, which is what the rejection
sampler assumes when it gets no draft probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        assert num_speculative_tokens >= 1 and 1 <= min_n <= max_n
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose_batch(self, contexts: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """req_id -> tokens so far in; req_id -> drafts out, for the requests that have any."""
        proposals = {req_id: self.propose(token_ids) for req_id, token_ids in contexts.items()}
        return {req_id: drafts for req_id, drafts in proposals.items() if drafts}

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        """Nothing to free: the n-gram proposer keeps no per-request state."""

    @property
    def num_requests(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Up to num_speculative_tokens drafts; [] when no n-gram of length min_n..max_n recurs.

        The longest matching n wins; among its matches, the most recent one.
        ```
        tokens: ... a b c x y z ... a b c |      (suffix "a b c", n = 3)
                    ^match  ^^^^^ proposed
        ```
        """
        num_tokens = len(token_ids)
        if num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidate match ends: earlier positions holding the last token. Excluding the last
        # position leaves each candidate followed by at least one token to propose.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # An n-gram match ending at e: tokens[e - n + 1 : e + 1] == tokens[-n:].
            matches = ends[ends >= n - 1]
            for offset in range(1, n):
                matches = matches[tokens[matches - offset] == tokens[num_tokens - 1 - offset]]
            if matches.size:
                start = int(matches[-1]) + 1
                return tokens[start : start + self.num_speculative_tokens].tolist()
        return []
