"""Each row's argmax on our kernel (`model.kernels.cpu.argmax`, a greedy step's choice) equals PyTorch's: random
rows short and vocabulary-long, ties (the first), NaN (the first NaN), rows of -inf, many rows at once (threads),
a non-contiguous view; other dtypes and devices go to PyTorch."""

from __future__ import annotations

import pytest
import torch

from tserve.model.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (2, 49152), (257, 300), (5, 151936)])
def test_argmax_equals_pytorchs(rows, n):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n))
    assert cpu_kernels.extension() is not None
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1))


def test_ties_nan_and_minus_infinity_as_pytorch_takes_them():
    x = torch.zeros(5, 40)
    x[0, [3, 17, 39]] = 2.0  # a tie: the first
    x[1, [5, 9]] = float("nan")  # NaN wins: the first NaN
    x[1, 2] = 100.0
    x[2] = float("-inf")  # nothing but -inf: the first
    x[3, 39] = float("inf")
    x[4, 31] = 1e-30
    got = cpu_kernels.argmax(x)
    assert got.tolist() == [3, 5, 0, 39, 31] == x.argmax(dim=-1).tolist()
    view = torch.randn(6, 80)[:, ::2]  # non-contiguous
    assert torch.equal(cpu_kernels.argmax(view), view.argmax(dim=-1))
    half = torch.randn(3, 50, dtype=torch.bfloat16)
    assert torch.equal(cpu_kernels.argmax(half), half.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_excluded_ids_are_written_minus_inf_and_never_chosen(dtype):
    """A greedy step's bans in the same call (`argmax(scores, excluded)`): each row's excluded ids written -inf in
    place, then the argmax of what is left, different ids per row; float64 goes to PyTorch's path, the same way."""
    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(3), dtype=dtype)
    x[0, 7] = x[1, 7] = x[2, 9] = 100.0  # each row's best ...
    x[0, 11] = x[2, 7] = 50.0  # ... and second best
    expected = x.clone()
    excluded = [[7, 0], [], [9, 7]]
    for row, ids in enumerate(excluded):
        expected[row, ids] = float("-inf")
    assert cpu_kernels.argmax(x, excluded).tolist() == expected.argmax(dim=-1).tolist() == [11, 7, int(expected[2].argmax())]
    assert torch.equal(x, expected)
    with pytest.raises((RuntimeError, IndexError)):
        cpu_kernels.argmax(x, [[49152], [], []])
