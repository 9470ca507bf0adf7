"""T5's relative position bias: a learned score per head for each bucket of key position - query position,
added to the attention scores of every self-attention layer of a stack (one table per stack, in its first
layer). Buckets are exact for small distances and logarithmic up to `max_distance`; the encoder's are
bidirectional (half the buckets for keys after the query), the decoder's look back only."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def relative_buckets(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Bucket of each relative position (key - query), as Mesh TensorFlow and `transformers`' T5 compute it."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    # log(0) is -inf for the small distances; torch.where picks the exact bucket for those.
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """(num_buckets, n_heads) table -> additive attention masks: the bias where a key may be attended, -inf
    where `allowed` says it may not."""

    def __init__(self, num_buckets: int, n_heads: int, max_distance: int, bidirectional: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(num_buckets, n_heads)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, query_positions: Tensor, key_len: int, allowed: Tensor, dtype: torch.dtype) -> Tensor:
        """query_positions (B or 1, Tq); allowed: boolean, broadcastable to (B, 1, Tq, key_len).
        Returns a float mask (B, H, Tq, key_len) for the attention backends."""
        keys = torch.arange(key_len, device=query_positions.device)
        relative = keys[None, None, :] - query_positions[:, :, None]  # (B, Tq, Tk)
        buckets = relative_buckets(relative, self.bidirectional, self.num_buckets, self.max_distance)
        bias = self.table(buckets).permute(0, 3, 1, 2).to(dtype)  # (B, H, Tq, Tk)
        return torch.where(allowed, bias, torch.tensor(float("-inf"), dtype=dtype, device=bias.device))
