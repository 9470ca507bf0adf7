"""Reading a paged KV cache's rows in tests."""

from __future__ import annotations

import torch


def row_keys(cache, rows: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a PagedKVCache
    """Every layer's keys of each row, read through its block table: (layers, rows, positions, heads, D)."""
    bs = cache.block_size
    index = (cache.tables[rows][:, :, None] * bs + torch.arange(bs, device=rows.device)).flatten(1)
    return cache.k[:, index]
