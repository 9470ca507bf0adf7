"""The CPU kernels on 1, 2 and 3 threads: each kernel splits its loop over PyTorch's threads (`torch.set_num_threads`,
or the decode step's team, `kernels/step_team.h`), and its result must not depend on how many threads run or on
how the rows, columns or heads fall between them (counts that are not a multiple of the threads or of a tile).
Each case is checked against the same call on one thread (bit for bit: every kernel's arithmetic for a row, a
column or a head is its own) and against a plain PyTorch statement of the maths. The suite itself runs on one
thread (`OMP_NUM_THREADS=1` in CI's workers): without these, a split the kernels take only on several threads
would go untested."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.model.test_block_kernels import _inputs, _layer
from tests.model.test_cpu_decode import blocks, paged, reference
from tests.model.test_dense_rows import operands
from tests.model.test_fused_decode import _steps_from, paged_cache, served
from tserve.model.block_quant import reference_linear
from tserve.model.fused_decode import FusedDecode
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.quantize import Int8Linear

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")]

THREADS = (1, 2, 3)
# Rows 1 .. 9 (every tile height of both paths), past two tiles, and counts odd against 2 and 3 threads.
ROW_COUNTS = (*range(1, 10), 17, 33)
EXT = cpu_kernels.extension() if cpu_kernels.available() else None
BLOCK_ISAS = EXT.block_isas() if EXT is not None else []
DENSE_PATHS = EXT.dense_rows_paths() if EXT is not None else []
# The decode attention's paths: the block kernels' ISAs over a float32 cache, and "" (the portable loops, what a
# bfloat16 / float16 cache or a head width that is not a multiple of 8 lanes takes on any path).
ATTENTION_PATHS = [*BLOCK_ISAS, ""]


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def on_each_thread_count(call):  # noqa: ANN001, ANN201 - a function of no arguments returning a tensor
    """call() on 1, 2 and 3 threads; asserts the 2- and 3-thread results equal the 1-thread one bit for bit."""
    results = {}
    for n in THREADS:
        with threads(n):
            results[n] = call()
    for n in THREADS[1:]:
        assert torch.equal(results[n], results[1]), (n, (results[n].double() - results[1].double()).abs().max())
    return results[1]


@pytest.mark.parametrize("path", DENSE_PATHS)
def test_dense_rows_give_the_same_bits_on_one_two_and_three_threads(path):
    """The float32 decode product splits its output columns in blocks of 24 weight rows over the threads: 5 blocks
    (the last one short) on 2 or 3 threads, every row count across the register tiles, equal to one thread's bits
    and to `F.linear`."""
    for m in ROW_COUNTS:
        x, w, b = operands(m, 100, 101, seed=m)
        got = on_each_thread_count(lambda x=x, w=w, b=b: EXT.dense_rows_on(x, w, b, path))
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5, msg=lambda s, m=m: f"{m} rows: {s}")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("isa", BLOCK_ISAS)
def test_block_layers_give_the_statements_bits_on_one_two_and_three_threads(isa, fmt):
    """Q8_0 / Q4_0 layers split their panels of 16 columns over the threads (4 panels, the last one of 2 columns):
    decode rows (one tile) and prompt rows (chunks of blocks), each equal to PyTorch's statement bit for bit."""
    layer = _layer(96, 50, fmt, isa=isa)
    codes, scales = layer.plain()
    for m in ROW_COUNTS:
        x = _inputs(m, 96, seed=m)
        got = on_each_thread_count(lambda x=x: layer(x))
        assert torch.equal(got, reference_linear(x, codes, scales, layer.bias, fmt)), (isa, fmt, m)


# (B, H, KV, D): one row of SmolLM2's 9 heads on 3 kv heads (2 threads split them in runs of one head, 3 threads
# a kv head each), grouped heads, one query head a kv head, a head width of 8 lanes but not of 16, and one the
# 8-lane loops do not take.
ATTENTION_SHAPES = [(1, 9, 3, 64), (1, 4, 2, 32), (2, 6, 6, 16), (1, 8, 2, 40), (3, 4, 2, 12)]


@pytest.mark.parametrize("B,H,KV,D", ATTENTION_SHAPES)
@pytest.mark.parametrize("isa", ATTENTION_PATHS)
def test_decode_attention_gives_the_same_bits_on_one_two_and_three_threads(isa, B, H, KV, D):
    """A few rows' heads split between the threads (a task a run of heads of one row): every head written, each
    equal on 1, 2 and 3 threads and to SDPA over the gathered blocks."""
    lengths = torch.tensor([37, 5, 64][:B])
    k, v, tables = paged(B, KV, D, 8, 9, seed=B + H)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(D))
    got = on_each_thread_count(
        lambda: cpu_kernels.paged_decode(q, blocks(k, 8), blocks(v, 8), tables, lengths, isa=isa))
    torch.testing.assert_close(got, reference(q, k, v, tables, lengths, 8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B", [1, 2, 3])
def test_a_half_precision_cache_gives_the_same_bits_on_one_two_and_three_threads(dtype, B):
    """A bfloat16 / float16 cache (a model served in that dtype) takes the portable loops on every path: one to
    three rows of 4 query heads on 2 kv heads, split by heads between the threads."""
    k, v, tables = paged(B, 2, 32, 8, 6, seed=11)
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(B, 4, 1, 32, generator=torch.Generator().manual_seed(12))
    lengths = torch.tensor([41, 9, 1][:B])
    got = on_each_thread_count(lambda: cpu_kernels.paged_decode(q, blocks(k, 8), blocks(v, 8), tables, lengths))
    torch.testing.assert_close(got, reference(q, k.float(), v.float(), tables, lengths, 8), atol=1e-5, rtol=1e-5)


def test_the_exact_int8_layer_gives_the_same_bits_on_one_two_and_three_threads():
    """`--int8-activations full` on our exact kernel: 5 panels of 16 columns (the last one of 3) split between the
    threads; every row count across its tiles of 6 rows, equal to one thread and near the float32 layer."""
    torch.manual_seed(3)
    linear = nn.Linear(70, 67)
    layer = Int8Linear(linear, "full", exact=True)
    for m in ROW_COUNTS:
        x = torch.randn(m, 70)
        got = on_each_thread_count(lambda x=x: layer(x))
        exact = linear(x).detach()
        assert (got - exact).abs().max() < 0.05 * exact.abs().max(), m


@pytest.mark.parametrize("activations", ["7bit", "split"])
def test_int8_row_mappings_give_the_same_bits_on_one_two_and_three_threads(activations):
    """The per-row mapping around PyTorch's int8 GEMM splits a prompt's rows between the threads once there are
    more than a task's (32K values a task: 512 rows of 64): 1,100 rows, equal to one thread's bits and to the
    chain of PyTorch calls it replaces."""
    torch.manual_seed(4)
    layer = Int8Linear(nn.Linear(64, 64), activations)
    x = torch.randn(1100, 64)
    got = on_each_thread_count(lambda: layer(x))
    assert torch.equal(got, layer._forward_in_steps(x))


def test_argmax_rows_give_pytorchs_choice_on_one_two_and_three_threads():
    """A batch of vocabulary-long rows splits a row a thread: 2 to 7 rows, each row's maximum somewhere else."""
    for rows in range(2, 8):
        x = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows))
        for r in range(rows):
            x[r, 1000 * r + 17] = 10.0
        got = on_each_thread_count(lambda x=x: cpu_kernels.argmax(x))
        assert got.tolist() == x.argmax(dim=-1).tolist() == [1000 * r + 17 for r in range(rows)]


@pytest.mark.parametrize("fmt", ["float32", "q8_0"])
def test_a_fused_step_on_three_threads_equals_the_step_on_one(fmt):
    """The decode step's team of three threads (thread 0 posts each loop, two helpers take the other chunks):
    the same logits, bit for bit, as one thread, from one cache state, three rows, 4 steps."""
    model = served("llama", fmt)
    cache = paged_cache(model, 3, seed=3)
    tokens = torch.tensor([[5, 17, 3, 0, 0, 0, 0], [40, 2, 9, 11, 60, 8, 1], [88, 0, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([3, 7, 1])
    with threads(1):
        model.prefill(tokens, lengths, cache, torch.arange(3))
    state = (cache.k.clone(), cache.v.clone())
    model.fused = FusedDecode.build(model)
    alone = _steps_from(model, cache, state, lengths, 1, 4)
    shared = _steps_from(model, cache, state, lengths, 3, 4)
    for step, (a, b) in enumerate(zip(alone, shared, strict=True)):
        assert a.abs().max() > 2.0, "a model whose logits are all near zero compares nothing"
        assert torch.equal(a, b), f"step {step}"
