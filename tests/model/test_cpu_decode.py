"""The CPU decode-attention kernel (`cpu-decode`, what `auto` is on the CPU): against SDPA over the gathered
blocks on random block tables, mixed lengths and grouped heads; a row's result alone and in a batch; bad block
tables refused; and the language model's and the translator's decode steps on it against `sdpa`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.fixture_training import assert_varied, cycle_prompts, lexicon_sentences
from tserve.model.attention import get_cached_decode, resolve_backend
from tserve.model.checkpoint import load
from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.model.decoding import SamplingParams, generate, translate
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.tokenizer import load_tokenizer

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

# The kernel's paths over a float32 cache that this CPU runs ("avx512": 16 lanes, a kv head's query heads
# together; "avx2": 8 lanes), each tested here whatever the process's own (`cpu_kernels.kernel_isa()`).
PATHS = (cpu_kernels.extension().block_isas() if cpu_kernels.available() else []) or [""]


def paged(B: int, KV: int, D: int, block: int, max_blocks: int, seed: int):
    """A pool of random keys/values (positions, KV, D) and B rows, each on its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + B * max_blocks
    k, v = (torch.randn(num_blocks * block, KV, D, generator=g) for _ in range(2))
    tables = (1 + torch.randperm(B * max_blocks, generator=g)).view(B, max_blocks)
    return k, v, tables


def blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    return t.view(-1, block, *t.shape[1:]).transpose(1, 2)  # (num_blocks, KV, block, D), as the cache hands out


def reference(q, k, v, tables, lengths, block, window=None):  # noqa: ANN001, ANN201
    """SDPA over each row's blocks gathered, its first `lengths[b]` positions (the last `window` of them, if
    given), kv heads repeated per group."""
    B, H, _, D = q.shape
    out = []
    for b in range(B):
        rows = torch.cat([torch.arange(i * block, (i + 1) * block) for i in tables[b].tolist()])[: lengths[b]]
        rows = rows[-window:] if window else rows
        kb, vb = (t[rows].transpose(0, 1).repeat_interleave(H // t.size(1), dim=0) for t in (k, v))
        out.append(F.scaled_dot_product_attention(q[b], kb, vb))
    return torch.stack(out)


@pytest.mark.parametrize("B,H,KV,D,block,lengths", [
    (5, 4, 4, 64, 16, [1, 16, 17, 40, 64]),  # one position, whole blocks, a block and one, ...
    (3, 8, 2, 32, 4, [7, 30, 2]),  # grouped query heads, small blocks
    (1, 6, 3, 80, 8, [45]),  # one row: the heads are split between threads
    (1, 9, 3, 64, 16, [130]),  # SmolLM2's heads, one row: 9 query heads on 3 kv heads, a task each
    (1, 4, 2, 128, 16, [70]),  # wide heads: the values' sums in two runs of registers
    (33, 2, 1, 16, 16, list(range(1, 34))),  # more rows than a thread takes at once
    (2, 14, 2, 64, 16, [33, 90]),  # Qwen2.5's heads: 7 query heads a kv head, in passes of 3, 3 and 1
    (1, 14, 2, 64, 16, [70]),  # the same, one row: a kv head's group a task
    (2, 4, 2, 40, 8, [9, 20]),  # a head width of 8 lanes but not of 16: the 8-lane loops on either path
])
@pytest.mark.parametrize("isa", PATHS)
def test_kernel_equals_sdpa_over_the_gathered_blocks(B, H, KV, D, block, lengths, isa):
    max_blocks = -(-max(lengths) // block) + 1  # a spare block: the length, not the table, ends a row
    k, v, tables = paged(B, KV, D, block, max_blocks, seed=B)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor(lengths)
    got = cpu_kernels.paged_decode(q, blocks(k, block), blocks(v, block), tables, lengths, isa=isa)
    torch.testing.assert_close(got, reference(q, k, v, tables, lengths, block), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 17])
@pytest.mark.parametrize("isa", PATHS)
def test_a_sliding_window_reads_each_rows_last_positions_only(window, isa):
    """Rows shorter than the window, as long, one longer, much longer; windows within a block and across them."""
    B, H, KV, D, block = 6, 4, 2, 32, 4
    lengths = torch.tensor([1, window, window + 1, 3 * window + 2, 40, 16])
    k, v, tables = paged(B, KV, D, block, 11, seed=window)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(2))
    got = cpu_kernels.paged_decode(q, blocks(k, block), blocks(v, block), tables, lengths, window=window, isa=isa)
    torch.testing.assert_close(got, reference(q, k, v, tables, lengths, block, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_precision_cache_is_read_in_float32(dtype):
    """A bfloat16 or float16 cache (a model served in that dtype): each key and value widened as it is read,
    the arithmetic in float32, as SDPA over the same values in float32 computes it."""
    k, v, tables = paged(4, 2, 32, 8, 5, seed=6)
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(4, 4, 1, 32, generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor([33, 1, 20, 8])
    got = cpu_kernels.paged_decode(q, blocks(k, 8), blocks(v, 8), tables, lengths)
    torch.testing.assert_close(got, reference(q, k.float(), v.float(), tables, lengths, 8), atol=1e-5, rtol=1e-5)
    half = cpu_kernels.paged_decode(q.to(dtype), blocks(k, 8), blocks(v, 8), tables, lengths)  # out in dtype
    widened = cpu_kernels.paged_decode(q.to(dtype).float(), blocks(k, 8), blocks(v, 8), tables, lengths)
    assert half.dtype == dtype and torch.equal(half, widened.to(dtype))


@pytest.mark.parametrize("isa", PATHS)
def test_a_rows_result_is_the_same_alone_and_in_any_batch(isa):
    """Alone, a row's heads are split between the threads; in the batch each thread takes whole rows."""
    k, v, tables = paged(9, 4, 64, 16, 4, seed=3)
    q = torch.randn(9, 8, 1, 64, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([50, 3, 64, 17, 33, 1, 60, 48, 20])
    batch = cpu_kernels.paged_decode(q, blocks(k, 16), blocks(v, 16), tables, lengths, isa=isa)
    for b in (0, 4, 8):
        alone = cpu_kernels.paged_decode(q[b:b + 1], blocks(k, 16), blocks(v, 16), tables[b:b + 1], lengths[b:b + 1],
                                         isa=isa)
        assert torch.equal(alone, batch[b:b + 1])


def test_a_path_the_cpu_does_not_run_is_refused_not_swapped_for_another():
    """The path asked for is the path run: one no kernel has (or this CPU lacks) is an error, never the default."""
    k, v, tables = paged(1, 2, 16, 4, 4, seed=6)
    q = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(7))
    with pytest.raises(RuntimeError, match="neon"):
        cpu_kernels.paged_decode(q, blocks(k, 4), blocks(v, 4), tables, torch.tensor([9]), isa="neon")


@pytest.mark.parametrize("bad", [-1, 1 + 2 * 4])
def test_a_block_id_outside_the_cache_is_refused(bad):
    k, v, tables = paged(2, 2, 16, 4, 4, seed=5)
    tables[1, 2] = bad
    q = torch.zeros(2, 2, 1, 16)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.paged_decode(q, blocks(k, 4), blocks(v, 4), tables, torch.tensor([3, 12]))


def test_auto_is_cpu_decode_on_the_cpu():
    assert resolve_backend("auto", "cpu") == "cpu-decode"
    assert get_cached_decode("cpu-decode") is cpu_kernels.paged_decode
    with pytest.raises(ValueError, match="CPU"):
        resolve_backend("cpu-decode", "meta")


@pytest.mark.parametrize("grouping", [{}, {"n_kv_heads": 1}, {"n_kv_heads": 2, "head_dim": 24, "qk_norm": True}])
def test_lm_decode_step_with_mixed_lengths_equals_sdpa(grouping):
    cfg = DecoderConfig(vocab_size=50, d_model=32, n_heads=4 if grouping else 2, d_ff=64, n_layers=2,
                        max_seq_len=80, positions="rope" if grouping else "learned", **grouping)
    torch.manual_seed(0)
    ref = Decoder(cfg, backend="sdpa").eval()
    ours = Decoder(cfg, backend="cpu-decode").eval()
    ours.load_state_dict(ref.state_dict())
    prompts = [[1, 2, 3], list(range(5, 45)), [7]]
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(3, 40, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    slots = torch.tensor([4, 0, 2])
    outs = []
    for model in (ref, ours):
        cache = model.new_cache(5, 80)
        model.prefill(tokens, lengths, cache, slots)
        outs.append(model.decode_step(torch.tensor([9, 8, 7]), lengths, cache, slots))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def _twins(path):  # noqa: ANN001, ANN202
    """The checkpoint on `sdpa` and a copy on `cpu-decode`."""
    ref = load(path, backend="sdpa")
    ours = type(ref.model)(ref.config, backend="cpu-decode").eval()
    ours.load_state_dict(ref.model.state_dict())
    return ref, dataclasses.replace(ref, model=ours)


def test_lm_generation_equals_sdpa(tiny_lm):
    ref, ours = _twins(tiny_lm)  # trained: each prompt has its own continuation (fixture_training)
    tok = load_tokenizer(tiny_lm)
    prompts = [tok.encode(p) for p in cycle_prompts(4, seed=2)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = [s.generated for s in generate(ours, prompts, params)]
    assert_varied(got, min_distinct=1.0)
    assert got == [s.generated for s in generate(ref, prompts, params)]


@pytest.mark.parametrize("beams", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3 beams: 4-12 s, CI
def test_translation_equals_sdpa(tiny_mt, beams):
    """Self-attention from the rows' blocks and cross-attention from each source's blocks, read in place."""
    ref, ours = _twins(tiny_mt)  # trained: each source has its own translation (fixture_training)
    tok = load_tokenizer(tiny_mt)
    sources = [tok.encode(t) for t in lexicon_sentences(4, seed=9, max_words=10)]
    got = [s.output_ids for s in translate(ours, sources, beams, 20)]
    assert_varied(got, min_distinct=1.0)
    assert got == [s.output_ids for s in translate(ref, sources, beams, 20)]


def test_the_same_sources_elsewhere_name_the_same_build(tmp_path, monkeypatch):
    """The build's name depends on what the library is built from, not on where the sources lie: another checkout
    or a copy of the tree (each planted bug's) finds the build there is instead of compiling its own."""
    flags = cpu_kernels._flags()
    name = cpu_kernels._build_name(flags)
    for attr in ("_SOURCES", "_HEADERS"):
        copies = []
        for source in getattr(cpu_kernels, attr):
            copies.append(tmp_path / source.name)
            copies[-1].write_bytes(source.read_bytes())
        monkeypatch.setattr(cpu_kernels, attr, copies)
    assert cpu_kernels._build_name(flags) == name
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed")
    assert cpu_kernels._build_name(flags) != name


@pytest.mark.slow  # 2-7 s: a new interpreter imports the build
def test_a_build_is_named_by_its_inputs_and_imported_as_it_is(tmp_path):
    """The build directory is named by the sources, the flags and torch's and Python's versions (not by where the
    sources lie: checkouts of the same sources share it); a process that finds the build imports it without
    PyTorch's builder (what the Docker image, which has no compiler, does)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    flags = cpu_kernels._flags()
    name = cpu_kernels._build_name(flags)
    assert cpu_kernels.available()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    assert (root / name / f"{name}.so").is_file()
    assert cpu_kernels._build_name([*flags, "-DOTHER"]) != name
    no_builder = ("import sys\nfrom torch.utils import cpp_extension\ncpp_extension.load = None\n"
                  "from tserve.model.kernels import cpu\nsys.exit(0 if cpu.available() else 1)\n")
    root_dir = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", no_builder], cwd=root_dir, timeout=120).returncode == 0
