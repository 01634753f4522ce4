"""Draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens.

Each step, for every request that just sampled, the draft
1. catches up: runs the tokens the target accepted that the draft has no KV for (the whole
   prompt on first sight; afterwards the corrected/bonus token and any accepted guesses whose KV
   it did not write), one flat batch over all requests, and takes the argmax at the last position;
2. runs k - 1 single-token decode steps batched across requests, feeding back its own argmax.
```
target tokens:  t0 ... t(L-1)                       (L = context length after this step)
draft KV:       t0 ... t(c-1) | catch-up t(c)..t(L-1) | d0 ... d(k-2)   -> proposes d0 ... d(k-1)
```
Its KV thus covers the guesses d0..d(k-2); next step, the positions whose token the target kept
stay valid, and the first position whose token differs (a rejected guess) and everything after
it are recomputed. Which positions are valid is found by comparing the tokens, so preemption,
recomputation or any accept/reject pattern need no special case.

The drafts are greedy (argmax, no sampling params): a point-mass draft distribution, verified by
the rejection sampler with draft_probs=None exactly like n-gram drafts, so sampling stays
lossless for any target sampling settings. The draft's KV is its own (draft_kv.py), freed when
the target's request finishes, is aborted or is preempted.

A self-draft ("model": "self") runs the target's own first `draft_num_layers` layers, final norm
and head: the same weights (no second copy), its own KV.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pagedserve.attention import forward_context
from pagedserve.attention.metadata import build_attention_metadata
from pagedserve.config import ModelConfig
from pagedserve.spec_decode.draft_kv import DraftKVCache, DraftRequestState
from pagedserve.tokenizer import Tokenizer


class DraftModelProposer:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        num_layers: int,
        num_speculative_tokens: int,
        target_vocab_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        uses_layer_prefix: bool = False,
    ) -> None:
        """model: the draft (or, with uses_layer_prefix, the target run for num_layers layers).
        target_vocab_size: guesses are restricted to ids the target's logits cover."""
        self.model = model
        self.num_layers = num_layers
        self.uses_layer_prefix = uses_layer_prefix
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = min(model_config.vocab_size, target_vocab_size)
        self.device = device
        self.kv = DraftKVCache(
            num_layers, num_blocks, block_size, model_config.num_key_value_heads,
            model_config.head_dim, dtype, device,
        )

    # ---- the proposer interface -----------------------------------------------------------

    @torch.inference_mode()
    def propose_batch(self, contexts: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """req_id -> its tokens so far (prompt + accepted outputs) in; req_id -> k guesses out.
        A request the draft pool has no room for gets none this step (and its draft KV is
        dropped: it is recomputed when room returns)."""
        k = self.num_speculative_tokens
        batch: list[tuple[str, DraftRequestState, Sequence[int], int]] = []
        for req_id, token_ids in contexts.items():
            state = self.kv.get_or_create(req_id)
            start = min(common_prefix_len(state.kv_token_ids, token_ids), len(token_ids) - 1)
            # Positions written this step: the catch-up up to L - 1, then d0 .. d(k-2).
            if not self.kv.reserve(req_id, len(token_ids) + k - 1):
                self.kv.free(req_id)
                continue
            del state.kv_token_ids[start:]
            batch.append((req_id, state, token_ids, start))
        if not batch:
            return {}
        # Decodes (one catch-up token) first: the attention backend batches them together.
        batch.sort(key=lambda item: len(item[2]) - item[3] != 1)

        input_ids, positions, chunks = [], [], []
        for _, state, token_ids, start in batch:
            input_ids.extend(token_ids[start:])
            positions.extend(range(start, len(token_ids)))
            chunks.append((state, start, len(token_ids)))
            state.kv_token_ids.extend(token_ids[start:])
        guesses = self._forward_last_argmax(input_ids, positions, chunks)
        drafts = [[token_id] for token_id in guesses]

        # k - 1 decode steps: feed each request's latest guess at the next position.
        for _ in range(k - 1):
            chunks = []
            positions = []
            for (_, state, _, _), draft in zip(batch, drafts):
                position = len(state.kv_token_ids)
                state.kv_token_ids.append(draft[-1])
                positions.append(position)
                chunks.append((state, position, position + 1))
            guesses = self._forward_last_argmax([d[-1] for d in drafts], positions, chunks)
            for draft, token_id in zip(drafts, guesses):
                draft.append(token_id)
        return {req_id: draft for (req_id, _, _, _), draft in zip(batch, drafts)}

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.kv.free(req_id)

    @property
    def num_requests(self) -> int:
        return len(self.kv.requests)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # ---- one draft forward pass -------------------------------------------------------------

    def _forward_last_argmax(
        self,
        input_ids: list[int],
        positions: list[int],
        chunks: list[tuple[DraftRequestState, int, int]],
    ) -> list[int]:
        """One flat pass; chunks: (state, first position, end position) per request, one-token
        chunks first. Returns the argmax at each chunk's last position."""
        meta = build_attention_metadata(
            [(state.block_ids, start, end) for state, start, end in chunks],
            self.kv.block_size, self.kv.kv_caches, self.device)
        device = self.device
        input_ids_t = torch.tensor(input_ids, dtype=torch.int64, device=device)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
        with forward_context(meta):
            if self.uses_layer_prefix:
                hidden_states = self.model(input_ids_t, positions_t, num_layers=self.num_layers)
            else:
                hidden_states = self.model(input_ids_t, positions_t)
        last = torch.tensor(meta.query_start_loc[1:], device=device) - 1
        logits = self.model.compute_logits(hidden_states[last])
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix. Usually they agree but for the last few tokens:
    compare the whole overlap at C speed first, then binary-search the first difference."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if list(a[:mid]) == list(b[:mid]):
            low = mid
        else:
            high = mid
    return low


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """A draft guesses token ids; they mean the same text only if the vocabularies are equal."""
    problems = []
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))
        problems.append(f"vocabularies differ ({len(target_vocab)} vs {len(draft_vocab)} tokens; "
                        f"{len(differing)} (token, id) pairs not shared, e.g. {differing[:3]})")
    if (target.bos_token_id, target.eos_token_id) != (draft.bos_token_id, draft.eos_token_id):
        problems.append(f"special tokens differ: bos/eos {target.bos_token_id}/"
                        f"{target.eos_token_id} vs {draft.bos_token_id}/{draft.eos_token_id}")
    if problems:
        raise ValueError(f"draft model {draft_name!r} does not share the target's tokenizer: "
                         + "; ".join(problems))
