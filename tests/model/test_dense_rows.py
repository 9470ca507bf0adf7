"""The float32 product for a decode step's few rows (`dense_rows.cpp`, the fused step's float32 layers and output
layer): on each path this CPU runs (AVX-512, AVX2), against `F.linear` on odd shapes and every row count across the
register tiles' edges, a row's result the same alone and in any batch, the bias on its own column, and the path a
process takes following PyTorch's own kernels' capability."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tserve
from tserve.model.kernels import cpu as cpu_kernels
from tserve.testing.avx2_only import AVX2_ONLY

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")]

# The paths this CPU runs (`dense_rows_paths` says the same once the kernels are loaded): a path the CPU lacks is
# not collected, rather than skipped (CI fails any skip).
_FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
PATHS = ("avx512", "avx2") if "avx512f" in _FLAGS else ("avx2",)
# Input rows 1 .. 9 and past two tiles: every tile width of both paths (AVX2's tiles are 4 rows wide, AVX-512's 8)
# and the narrower tile after whole ones.
ROW_COUNTS = (*range(1, 10), 13, 17)


def operands(M: int, K: int, N: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K**0.5, torch.randn(N, generator=g))


@pytest.fixture(params=PATHS)
def on_path(request):
    """`dense_rows` on one path of this CPU's."""
    ext = cpu_kernels.extension()
    assert request.param in ext.dense_rows_paths()
    return lambda x, w, b: ext.dense_rows_on(x, w, b, request.param)


@pytest.mark.parametrize("M,K,N", [
    (1, 576, 960),  # SmolLM2's q/k/v: whole blocks of weight rows, K a multiple of 16
    (3, 37, 13),  # K and N neither: one short block, 5 products in a part vector
    (8, 8, 1), (1, 1, 9),  # one weight row; one input feature
    (40, 64, 100),  # more rows than a decode step's usual batch
])
def test_equals_linear(on_path, M, K, N):
    x, w, b = operands(M, K, N, seed=M * K + N)
    torch.testing.assert_close(on_path(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on_path(x, w, None), F.linear(x, w), atol=1e-5, rtol=1e-5)


# K: 100 = 6 x 16 + 4 (12 x 8 + 4); N: 2 blocks of 24 weight rows and 5 (tiles of 8, 6, 4 or 3 rows, then single
# rows).
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_every_row_count_equals_linear(on_path, M):
    x, w, b = operands(M, 100, 53, seed=M)
    torch.testing.assert_close(on_path(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("M", ROW_COUNTS)
def test_a_rows_result_is_the_same_alone_and_in_any_batch(on_path, M):
    """Each row alone and every run of rows from every start equal the whole batch's rows, bit for bit: a row's
    arithmetic is the same in whatever tile, of whatever width, at whatever place it falls."""
    x, w, b = operands(M, 100, 53, seed=100 + M)
    batch = on_path(x, w, b)
    for m in range(M):
        assert torch.equal(on_path(x[m:m + 1], w, b), batch[m:m + 1]), m
    for start in range(M):
        assert torch.equal(on_path(x[start:], w, b), batch[start:]), start


def test_each_bias_is_added_to_its_own_column(on_path):
    """Zero inputs: the output is the bias, column by column (a bias added to the next column fails here)."""
    _, w, b = operands(1, 24, 53, seed=5)
    out = on_path(torch.zeros(2, 24), w, b)
    assert torch.equal(out, b.expand(2, -1))


_TAKEN_PATH = """
import torch
from tserve.model.kernels import cpu
ext = cpu.extension()
g = torch.Generator().manual_seed(7)
x, w = torch.randn(5, 1000, generator=g), torch.randn(40, 1000, generator=g)
taken = ext.dense_rows(x, w, None)
print(next(p for p in ext.dense_rows_paths() if torch.equal(taken, ext.dense_rows_on(x, w, None, p))))
"""


def taken_path(env: dict[str, str]) -> str:
    """The path `dense_rows` takes in a process with `env` (it is decided once a process): the one whose result
    it equals bit for bit."""
    root = Path(tserve.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _TAKEN_PATH], env={**os.environ, **env, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.split()[-1]


def test_the_path_follows_pytorchs_capability():
    """`dense_rows` (what the fused step calls) runs AVX-512 where the CPU has it and PyTorch's kernels run at it,
    AVX2 where they are held to it (`tserve.testing.avx2_only`). The two paths' results differ (16 lanes summed
    against 8), so the result says which ran."""
    ext = cpu_kernels.extension()
    x, w, b = operands(5, 1000, 40, seed=7)
    if "avx512" not in ext.dense_rows_paths():  # an AVX2-only CPU: that path, whatever PyTorch runs at
        assert torch.equal(ext.dense_rows(x, w, b), ext.dense_rows_on(x, w, b, "avx2"))
        assert taken_path(AVX2_ONLY) == "avx2"
        return
    assert not torch.equal(ext.dense_rows_on(x, w, b, "avx512"), ext.dense_rows_on(x, w, b, "avx2"))
    wide = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert torch.equal(ext.dense_rows(x, w, b), ext.dense_rows_on(x, w, b, "avx512" if wide else "avx2"))
    assert taken_path(AVX2_ONLY) == "avx2"
