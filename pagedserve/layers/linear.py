"""Linear layers whose parameters know how to load their own shards.

A merged layer (QKV, gate-up) holds several HF weights side by side along the output dimension;
`weight_loader(param, loaded_weight, shard_id)` copies one of them into its slice. Tensor
parallelism later narrows these slices per rank here, not in the models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape {tuple(loaded_weight.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several output projections computed by one matmul: y = x @ [W_0; W_1; ...]^T."""

    def __init__(
        self, input_size: int, output_sizes: dict[str | int, int], bias: bool = False
    ) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.output_sizes = list(output_sizes.values())

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int
    ) -> None:
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.output_sizes, dim=-1)
