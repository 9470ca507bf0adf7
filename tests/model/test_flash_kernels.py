"""Our Triton flash kernels against the explicit `math` attention.

On a machine without CUDA, conftest turns on Triton's interpreter, which runs the very same kernels on CPU
tensors (float32 and float16; its bfloat16 matrix product is not faithful, so bfloat16 runs on GPUs only).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from tests.helpers.fixture_training import assert_varied, cycle_prompts, lexicon_sentences  # noqa: E402
from tserve.model.attention import get_backend, math_attention, padding_mask, resolve_backend  # noqa: E402
from tserve.model.checkpoint import load  # noqa: E402
from tserve.model.config import DecoderConfig, ViTConfig  # noqa: E402
from tserve.model.decoder import Decoder  # noqa: E402
from tserve.model.decoding import SamplingParams, generate, translate  # noqa: E402
from tserve.model.kernels import flash  # noqa: E402
from tserve.model.tokenizer import load_tokenizer  # noqa: E402
from tserve.model.vit import ViT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# The acceptance bar: float32 within 1e-5; half precision within 1e-2 relative error.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def qkv(B: int, H: int, Tq: int, Tk: int, D: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda T: torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype)  # noqa: E731
    return make(Tq), make(Tk), make(Tk)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert rel_err(out, ref) <= TOL[dtype]


SHAPES = [  # B, H, Tq, Tk, D, causal
    (2, 3, 37, 37, 32, True),  # prefill, lengths not a multiple of the block
    (1, 2, 130, 130, 64, True),  # several query and key blocks
    (2, 2, 5, 70, 24, True),  # a chunk of new queries after a cached prefix (bottom-right diagonal)
    (3, 2, 20, 33, 80, False),  # encoder, head size not a power of two
    (2, 4, 1, 100, 16, False),  # one query (cross-attention while decoding)
    (1, 1, 65, 65, 128, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Tq,Tk,D,causal", SHAPES)
def test_flash_attention_matches_math(B, H, Tq, Tk, D, causal, dtype):
    q, k, v = qkv(B, H, Tq, Tk, D, dtype)
    out, weights = flash.flash_attention(q, k, v, None, causal)
    ref, _ = math_attention(q.float(), k.float(), v.float(), None, causal)
    assert weights is None and out.dtype == dtype and out.shape == q.shape
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_key_padding(causal, dtype):
    B, H, T, D = 4, 2, 45, 32
    q, k, v = qkv(B, H, T, T, D, dtype, seed=1)
    lengths = torch.tensor([45, 1, 17, 33], device=DEVICE)
    mask = padding_mask(lengths, T)  # (B, 1, 1, T): broadcast, never expanded in memory
    out, _ = flash.flash_attention(q, k, v, mask, causal)
    ref, _ = math_attention(q.float(), k.float(), v.float(), mask, causal)
    check(out, ref, dtype)


def test_flash_attention_general_mask_and_fully_masked_rows():
    q, k, v = qkv(2, 2, 12, 12, 16, torch.float32, seed=2)
    mask = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.5
    mask[:, :, 3] = False  # a query that may attend to nothing
    out, _ = flash.flash_attention(q, k, v, mask, False)
    ref, _ = math_attention(q, k, v, mask, False)
    ok = ~torch.isnan(ref)
    torch.testing.assert_close(out[ok], ref[ok], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))  # zeros, not NaN


def test_flash_attention_refuses_dropout():
    q, k, v = qkv(1, 1, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="dropout"):
        flash.flash_attention(q, k, v, None, False, 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [32, 40])
def test_flash_decode_attends_each_slot_over_its_own_length(D, dtype):
    slots_total, H, L = 7, 2, 600  # 600 positions: split over several programs per head
    g = torch.Generator().manual_seed(4)
    k_cache = torch.randn(slots_total, H, L, D, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(slots_total, H, L, D, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([5, 0, 3, 6], device=DEVICE)
    lengths = torch.tensor([600, 1, 257, 64], device=DEVICE)  # mixed: one full, one single key, ...
    q = torch.randn(4, H, 1, D, generator=g).to(DEVICE, dtype)
    out = flash.flash_decode(q, k_cache, v_cache, slots[:, None], lengths)  # a static cache: one block per slot
    assert out.shape == q.shape and out.dtype == dtype
    for i in range(4):
        s, n = int(slots[i]), int(lengths[i])
        ref, _ = math_attention(q[i : i + 1].float(), k_cache[s : s + 1, :, :n].float(),
                                v_cache[s : s + 1, :, :n].float(), None, False)
        check(out[i : i + 1], ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_decode_reads_each_row_through_its_block_table(dtype):
    """Paged: a row's positions live in the scattered blocks its table names, 16 positions each, in the flat
    (positions, heads, D) layout of `PagedKVCache`; the kernel must follow the table block by block."""
    num_blocks, bs, H, D = 90, 16, 2, 32
    g = torch.Generator().manual_seed(5)
    k_flat = torch.randn(num_blocks * bs, H, D, generator=g).to(DEVICE, dtype)
    v_flat = torch.randn(num_blocks * bs, H, D, generator=g).to(DEVICE, dtype)
    blocks = lambda t: t.view(num_blocks, bs, H, D).transpose(1, 2)  # noqa: E731
    lengths = torch.tensor([300, 1, 17, 160], device=DEVICE)
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # every row's blocks scattered over the pool
    tables = order[:80].view(4, 20).to(DEVICE)
    q = torch.randn(4, H, 1, D, generator=g).to(DEVICE, dtype)
    out = flash.flash_decode(q, blocks(k_flat), blocks(v_flat), tables, lengths, 320)
    for i in range(4):
        n = int(lengths[i])
        index = (tables[i, :, None] * bs + torch.arange(bs, device=DEVICE)).flatten()[:n]
        k, v = (t[index].transpose(0, 1)[None].float() for t in (k_flat, v_flat))
        ref, _ = math_attention(q[i : i + 1].float(), k, v, None, False)
        check(out[i : i + 1], ref, dtype)


def test_decode_split_layout_covers_the_cache_in_whole_key_blocks():
    for max_len in (1, 63, 64, 256, 600, 1024, 4096, 100_000):
        n, size = flash.decode_splits(max_len)
        assert size % 64 == 0 and n * size >= max_len > (n - 1) * size and 1 <= n <= 16


def test_flash_is_refused_off_cuda(monkeypatch):
    for name in ("flash", "flash-decode"):
        with pytest.raises(ValueError, match="CUDA"):
            resolve_backend(name, "cpu")
    assert resolve_backend("auto", "cpu") == "cpu-decode"  # (not a Triton backend)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (torch.zeros(1, 1, 2, 16) for _ in range(3))
    with pytest.raises(ValueError, match="CUDA"):
        flash.flash_attention(q, k, v)


# --------------------------------------------------------------------------------------------------
# Whole models on the flash backend equal the math backend
# --------------------------------------------------------------------------------------------------
def _pair(make, backend="flash"):
    torch.manual_seed(0)
    ref = make("math").to(DEVICE).eval()
    fl = make(backend).to(DEVICE).eval()
    fl.load_state_dict(ref.state_dict())
    assert get_backend("flash") is flash.flash_attention
    return ref, fl


def _twins(path):
    """The checkpoint at `path` on the `math` backend and a copy on `flash`, both float32 (on CUDA the loader's
    `auto` dtype is bfloat16, whose rounding would decide near-ties differently on the two backends)."""
    ref = load(path, device=DEVICE, dtype="float32", backend="math")
    fl = type(ref.model)(ref.config, backend="flash").to(DEVICE).eval()
    fl.load_state_dict(ref.model.state_dict())
    assert get_backend("flash") is flash.flash_attention
    return ref, dataclasses.replace(ref, model=fl)


@pytest.mark.slow  # 5-7 s in Triton's interpreter; on a GPU it runs natively
def test_lm_cached_generation_on_flash_equals_math(tiny_lm):
    ref, fl = _twins(tiny_lm)  # trained: each prompt has its own continuation (fixture_training)
    tok = load_tokenizer(tiny_lm)
    # 12 steps: Triton's interpreter runs every kernel instance in Python, about 0.1 s a step on the CPU.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for text in cycle_prompts(3, seed=9):
        prompt = tok.encode(text)
        outputs.append(generate(fl, [prompt], params)[0].generated)
        assert outputs[-1] == generate(ref, [prompt], params)[0].generated
        tokens = torch.tensor([prompt], device=DEVICE)
        torch.testing.assert_close(fl.model(tokens), ref.model(tokens), atol=1e-5, rtol=1e-5)
    assert_varied(outputs, min_distinct=1.0)


# The kernels see what the families' attention differs in, not their tokenizers: a head size other than hidden /
# heads (qwen3) and layers without positions (smollm3); every family has 2 kv heads for 4 query heads.
@pytest.mark.slow
@pytest.mark.parametrize("hf_family", ["qwen3", "smollm3"], indirect=True)
def test_grouped_query_family_on_flash_equals_math(hf_family):
    """GQA (2 kv heads for 4 query heads): prefill repeats kv heads, the decode kernel maps each query head to
    its kv head in the cache."""
    family, path = hf_family
    ref, fl = _twins(path)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [ref.tokenizer.encode(t) for t in cycle_prompts(2, seed=4)]
    got = [s.generated for s in generate(fl, prompts, params)]
    assert got == [s.generated for s in generate(ref, prompts, params)], family
    assert_varied(got, min_distinct=1.0)


@pytest.mark.parametrize("backend", ["flash", "flash-decode"])
@pytest.mark.parametrize("grouping", [{}, {"n_kv_heads": 1}, {"n_kv_heads": 2, "head_dim": 24, "qk_norm": True}])
def test_lm_decode_step_with_mixed_lengths_on_flash_equals_math(grouping, backend):
    """`flash-decode` (what `auto` is on CUDA) prefills with SDPA and decodes with the Triton kernel."""
    cfg = DecoderConfig(vocab_size=50, d_model=32, n_heads=4 if grouping else 2, d_ff=64, n_layers=2,
                        max_seq_len=80, positions="rope" if grouping else "learned", **grouping)
    ref, fl = _pair(lambda b: Decoder(cfg, backend=b), backend)
    assert fl.blocks[0].attn._cached_decode is flash.flash_decode
    prompts = [[1, 2, 3], list(range(5, 45)), [7]]
    lengths = torch.tensor([len(p) for p in prompts], device=DEVICE)
    tokens = torch.zeros(3, 40, dtype=torch.long, device=DEVICE)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    outs = []
    for model in (ref, fl):
        cache = model.new_cache(5, 80)
        model.prefill(tokens, lengths, cache, slots)
        nxt = torch.tensor([9, 8, 7], device=DEVICE)
        outs.append(model.decode_step(nxt, lengths, cache, slots))  # whole static cache, per-row lengths
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # 9-16 s in Triton's interpreter; on a GPU it runs natively
def test_translation_on_flash_equals_math(tiny_mt):
    ref, fl = _twins(tiny_mt)  # trained: each source has its own translation (fixture_training)
    tok = load_tokenizer(tiny_mt)
    sources = [tok.encode(t) for t in lexicon_sentences(3, seed=9, max_words=6)]  # short: interpreted kernels
    got = [s.output_ids for s in translate(fl, sources, 1, 14)]
    assert_varied(got, min_distinct=1.0)
    assert got == [s.output_ids for s in translate(ref, sources, 1, 14)]


def test_vit_on_flash_equals_math():
    cfg = ViTConfig(image_size=28, patch_size=4, n_channels=1, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                    n_classes=10)
    ref, fl = _pair(lambda b: ViT(cfg, backend=b))
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    torch.testing.assert_close(fl(x), ref(x), atol=1e-5, rtol=1e-5)
