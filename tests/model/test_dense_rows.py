"""The float32 product for a decode step's few rows (`dense_rows.cpp`, the fused step's float32 layers and output
layer): against `F.linear` on odd shapes, a row's result the same alone and in any batch, and the bias on its own
column."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tserve.model.kernels import cpu as cpu_kernels

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")]


def operands(M: int, K: int, N: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K**0.5, torch.randn(N, generator=g))


@pytest.mark.parametrize("M,K,N", [
    (1, 576, 960),  # SmolLM2's q/k/v: whole blocks of 8 weight rows, K a multiple of 8
    (3, 37, 13),  # K and N neither: the last block of 5 rows, 5 products after the lanes
    (8, 8, 1), (1, 1, 9),  # one weight row; one input feature
    (40, 64, 100),  # more rows than a decode step's usual batch
])
def test_equals_linear(M, K, N):
    x, w, b = operands(M, K, N, seed=M * K + N)
    ext = cpu_kernels.extension()
    torch.testing.assert_close(ext.dense_rows(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ext.dense_rows(x, w, None), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_a_rows_result_is_the_same_alone_and_in_any_batch():
    x, w, b = operands(9, 100, 21, seed=3)
    ext = cpu_kernels.extension()
    batch = ext.dense_rows(x, w, b)
    for m in (0, 4, 8):
        assert torch.equal(ext.dense_rows(x[m:m + 1], w, b), batch[m:m + 1])
    assert torch.equal(ext.dense_rows(x[2:7], w, b), batch[2:7])


def test_each_bias_is_added_to_its_own_column():
    """Zero inputs: the output is the bias, column by column (a bias added to the next column fails here)."""
    _, w, b = operands(1, 24, 19, seed=5)
    out = cpu_kernels.extension().dense_rows(torch.zeros(2, 24), w, b)
    assert torch.equal(out, b.expand(2, -1))
