"""RMSNorm, shared by the blocks and by attention's per-head query/key norm."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back before the weight (as Llama's).

    `offset` (Gemma): x / rms(x) * (offset + weight), all in float32 and cast back after, as Gemma computes it:
    its weights are stored as offsets from one, and a bfloat16 one plus a small weight would round."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return normed.to(x.dtype) * self.weight
