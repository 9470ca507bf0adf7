"""Reading a paged KV cache's rows in tests."""

from __future__ import annotations

import torch


def row_keys(cache, rows: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a PagedKVCache
    """Every layer's keys of each row, read through its block table: (layers, rows, positions, heads, D)."""
    bs = cache.block_size
    index = (cache.tables[rows][:, :, None] * bs + torch.arange(bs, device=rows.device)).flatten(1)
    return cache.k[:, index]


def eager_multi_token_step(model, fed: list[list[int]], computed: list[int], cache, rows: list[int],  # noqa: ANN001
                           device: torch.device | str = "cpu") -> torch.Tensor:
    """The unpadded reference of a speculative step: each row's `fed` tokens (right-padded with 0) from its
    `computed` positions on, through `decode_tokens` over exactly the positions in use; logits (B, T, V)."""
    longest = max(map(len, fed))
    tokens = torch.tensor([f + [0] * (longest - len(f)) for f in fed], device=device)
    positions = torch.tensor(computed, device=device)[:, None] + torch.arange(longest, device=device)
    return model.decode_tokens(tokens, positions, cache, torch.tensor(rows, device=device),
                               kv_len=int(positions.max()) + 1)


def advance_if_real_rows_equal(padded: torch.Tensor, ref: torch.Tensor, fed: list[list[int]], computed: list[int],
                               tol: float) -> tuple[list[int], list[int]]:
    """Each row's logits at its real positions of a padded step equal the reference's; returns the positions
    computed after the step and each row's greedy next token."""
    assert padded.shape == ref.shape
    for i, f in enumerate(fed):
        torch.testing.assert_close(padded[i, : len(f)], ref[i, : len(f)], atol=tol, rtol=tol)
    return ([c + len(f) for c, f in zip(computed, fed, strict=True)],
            [int(ref[i, len(f) - 1].argmax()) for i, f in enumerate(fed)])
