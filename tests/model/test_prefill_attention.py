"""The CPU attention kernel of whole sequences (`kernels.cpu.prefill_attention`, `cpu-decode`'s prefill and
unmasked encoders): each path against attention in float64 over grouped heads, causal prompts after a cached
prefix, heads of 8 to 128 channels and lengths around its tiles; a query's result whatever the batch, the threads
and the prompt's later positions; the calls it does not take left to `sdpa`; and whole models on it against
`sdpa`."""

from __future__ import annotations

import math

import pytest
import torch

from tserve.model import attention
from tserve.model.attention import cpu_kernel_attention, sdpa_attention
from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.model.kernels import cpu as cpu_kernels

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

PATHS = cpu_kernels.extension().block_isas() if cpu_kernels.available() else []
needs_kernels = pytest.mark.skipif(not PATHS, reason="the CPU kernels do not run on this CPU")

# (B, H, KV, Tq, Tk, D, causal): grouped heads of 1, 3 and 7 queries a kv head; a prompt after a cached prefix
# (Tq < Tk); lengths around the key tiles (32 / 64 keys) and the row tiles (6 rows); a single query.
SHAPES = (
    (1, 9, 3, 100, 100, 64, True),
    (2, 4, 4, 37, 50, 32, True),
    (1, 12, 12, 70, 70, 64, False),
    (1, 6, 2, 5, 300, 128, True),
    (1, 2, 1, 1, 1, 16, True),
    (1, 14, 2, 129, 193, 64, True),
    (1, 7, 1, 65, 65, 96, False),
    (2, 4, 2, 33, 33, 80, True),
    (1, 4, 4, 13, 13, 8, True),
)


def inputs(B: int, H: int, KV: int, Tq: int, Tk: int, D: int, seed: int = 0):
    """q (B, H, Tq, D), k and v (B, KV, Tk, D) as the attention module hands them over: views of (B, T, heads, D)
    projections. Scores spread wide enough that each query's weights are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    q = (2.0 * torch.randn(B, Tq, H, D, generator=g)).transpose(1, 2)
    k, v = (torch.randn(B, Tk, KV, D, generator=g).transpose(1, 2) for _ in range(2))
    return q, k, v


def reference(q, k, v, causal: bool) -> torch.Tensor:  # noqa: ANN001
    """Attention in float64, each query the last of its position among the Tk keys when causal."""
    group = q.size(1) // k.size(1)
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        Tq, Tk = q.size(-2), k.size(-2)
        scores = scores.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq), float("-inf"))
    return torch.softmax(scores, -1) @ v


def paths_for(D: int) -> list[str]:
    return [isa for isa in PATHS if D % (16 if isa == "avx512" else 8) == 0]


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + ("-causal" if s[6] else ""))
def test_each_path_equals_attention_in_float64(shape):
    *dims, causal = shape
    q, k, v = inputs(*dims)
    expected = reference(q, k, v, causal)
    for isa in paths_for(dims[-1]):
        out = cpu_kernels.prefill_attention(q, k, v, causal, isa=isa)
        assert out.shape == q.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5, msg=isa)


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
def test_a_querys_result_is_its_own_whatever_the_batch_the_threads_or_the_later_positions(isa):
    """Each query's sums run in one order set by its own position alone: bitwise the same in a batch of two, on
    one thread or two, and in a prompt cut after it (what a shorter prompt, or one prefilled in pieces, computes)."""
    q, k, v = inputs(2, 6, 2, 150, 150, 64, seed=1)
    full = cpu_kernels.prefill_attention(q, k, v, True, isa=isa)
    alone = cpu_kernels.prefill_attention(q[1:], k[1:], v[1:], True, isa=isa)
    assert torch.equal(full[1:], alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.prefill_attention(q, k, v, True, isa=isa), full)
    finally:
        torch.set_num_threads(threads)
    for cut in (1, 7, 64, 97):
        shorter = cpu_kernels.prefill_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], True, isa=isa)
        assert torch.equal(shorter, full[:, :, :cut]), cut
    # the last queries after a cached prefix: the same rows of the whole prompt's
    tail = cpu_kernels.prefill_attention(q[:, :, 120:], k, v, True, isa=isa)
    assert torch.equal(tail, full[:, :, 120:])


@needs_kernels
def test_the_output_is_laid_out_as_the_output_projection_reads_it():
    q, k, v = inputs(1, 4, 2, 20, 20, 16)
    out = cpu_kernels.prefill_attention(q, k, v, True)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, D): the projection's (B, T, H * D) with no copy
    contiguous = cpu_kernels.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), True)
    assert torch.equal(contiguous, out)


@needs_kernels
def test_cpu_decode_takes_a_prompts_attention_and_leaves_the_rest_to_sdpa(monkeypatch):
    calls = []
    kernel = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    q, k, v = inputs(1, 6, 2, 24, 24, 16)
    expected = sdpa_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), None, True)[0]

    out, weights = cpu_kernel_attention(q, k, v, None, True)
    assert calls == [1] and weights is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    mask = torch.ones(1, 1, 24, 24, dtype=torch.bool).tril()
    mask[..., 0] = False  # a mask the kernel cannot read: sdpa, with its grouped heads repeated
    masked = sdpa_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask, False)[0]
    torch.testing.assert_close(cpu_kernel_attention(q, k, v, mask, False)[0], masked)
    trained = q.clone().requires_grad_()
    out = cpu_kernel_attention(trained, k, v, None, True)[0]
    out.sum().backward()  # gradients: sdpa's, which has them
    assert trained.grad is not None
    for other in (q.double(), q[..., :12]):  # another dtype; a head size no path takes
        cpu_kernel_attention(other, k.to(other.dtype)[..., : other.size(-1)],
                             v.to(other.dtype)[..., : other.size(-1)], None, True)
    starts = torch.tensor([3])  # rows after prefixes, off the kernel: sdpa is handed their causal mask
    narrow = [t[..., :12] for t in (q[..., :10, :], k, v)]
    torch.testing.assert_close(cpu_kernel_attention(*narrow, None, True, starts=starts)[0].double(),
                               reference_from(*narrow, starts), atol=1e-5, rtol=1e-5)
    assert calls == [1]
    assert attention.get_backend("cpu-decode") is cpu_kernel_attention
    assert attention.get_backend("sdpa") is sdpa_attention


@needs_kernels
def test_a_head_of_eight_channels_takes_the_avx2_path_on_any_cpu():
    q, k, v = inputs(1, 4, 4, 10, 10, 8)
    assert cpu_kernels.prefill_path(q, k, "avx512") == "avx2"
    assert cpu_kernels.prefill_path(q, k, "avx2") == "avx2"
    assert cpu_kernels.prefill_path(q[..., :4], k[..., :4], "avx2") is None
    # Asked for anyway, the AVX-512 path refuses: for the head's width, or on a CPU without AVX-512 for that.
    refusal = "multiple of 16" if "avx512" in PATHS else "does not run the block kernels' avx512 path"
    with pytest.raises(RuntimeError, match=refusal):
        cpu_kernels.prefill_attention(q, k, v, True, isa="avx512")


@needs_kernels
@pytest.mark.parametrize("grouping", [{}, {"n_kv_heads": 1}, {"n_kv_heads": 2, "head_dim": 32, "qk_norm": True}])
def test_a_models_prefill_and_its_next_steps_on_cpu_decode_equal_sdpa(grouping):
    """Right-padded prompts of mixed lengths prefilled together (causal, no mask: the padding comes last), then
    decode steps over what they wrote."""
    cfg = DecoderConfig(vocab_size=50, d_model=64, n_heads=4, d_ff=64, n_layers=2, max_seq_len=160,
                        positions="rope", **grouping)
    torch.manual_seed(0)
    ref = Decoder(cfg, backend="sdpa").eval()
    ours = Decoder(cfg, backend="cpu-decode").eval()
    ours.load_state_dict(ref.state_dict())
    prompts = [[1, 2, 3], list(range(5, 45)) * 3, [7]]
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(3, int(lengths.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    slots = torch.tensor([2, 0, 1])
    outs = []
    for model in (ref, ours):
        cache = model.new_cache(3, 160)
        first = model.prefill(tokens, lengths, cache, slots)
        outs.append((first, model.decode_step(torch.tensor([9, 8, 7]), lengths, cache, slots)))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("window", [None, 24])
def test_prompts_after_their_cached_prefixes_run_on_the_kernel_and_equal_sdpa(monkeypatch, window):
    """Prompts whose first positions are already in the cache (prefix cache hits, later turns), alone and two of
    different prefix lengths together: each row's queries start at its own first position, read by the kernel with
    no mask, the same alone and batched; equal to `sdpa` (which is handed the mask); a sliding-window layer
    keeps its window's mask (and `sdpa`)."""
    shapes = []
    kernel = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention",
                        lambda q, k, *a, **kw: shapes.append((q.size(2), k.size(2))) or kernel(q, k, *a, **kw))
    extra = {} if window is None else {"sliding_window": window, "sliding_layers": [0]}
    cfg = DecoderConfig(vocab_size=50, d_model=64, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2, max_seq_len=160,
                        positions="rope", **extra)
    torch.manual_seed(1)
    ref = Decoder(cfg, backend="sdpa").eval()
    ours = Decoder(cfg, backend="cpu-decode").eval()
    ours.load_state_dict(ref.state_dict())
    prompts = [[(5 * i + 3) % 47 + 1 for i in range(90)], [(3 * i + 7) % 43 + 2 for i in range(70)]]
    cached = [64, 20]  # each prompt's prefix already in the cache

    def run(model, rows):  # noqa: ANN001, ANN202
        cache = model.new_cache(2, 160)
        slots = torch.tensor(rows)
        for i, r in enumerate(rows):  # the prefixes, each alone
            model.prefill(torch.tensor([prompts[r][: cached[r]]]), torch.tensor([cached[r]]), cache, slots[i:i + 1])
        rest = [prompts[r][cached[r]:] for r in rows]
        tokens = torch.zeros(len(rows), max(map(len, rest)), dtype=torch.long)
        for i, t in enumerate(rest):
            tokens[i, : len(t)] = torch.tensor(t)
        return model.prefill(tokens, torch.tensor([len(t) for t in rest]), cache, slots,
                             start=torch.tensor([cached[r] for r in rows]))

    torch.testing.assert_close(run(ours, [0, 1]), run(ref, [0, 1]), atol=1e-5, rtol=1e-5)
    layers = 1 if window is not None else 2  # the sliding layer's calls carry its window's mask: sdpa's
    assert shapes.count((50, 90)) == layers  # the two rows' rests (26 and 50 positions) together, no mask
    together = run(ours, [0, 1])  # the rows alone: the same within the products' rounding (the kernel's part is
    for i in range(2):              # bitwise the same: test_rows_after_prefixes_of_their_own_lengths_...)
        torch.testing.assert_close(run(ours, [i])[0], together[i], atol=1e-6, rtol=1e-6)


def reference_from(q, k, v, starts) -> torch.Tensor:  # noqa: ANN001
    """Float64 attention of row b's queries at positions starts[b] + t (those past the keys attend to all)."""
    group = q.size(1) // k.size(1)
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    positions = starts[:, None] + torch.arange(q.size(2))
    allowed = torch.arange(k.size(2))[None, None, :] <= positions[:, :, None]  # (B, Tq, Tk)
    return torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1) @ v


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
def test_rows_after_prefixes_of_their_own_lengths_each_attend_from_their_own_start(isa):
    """A batch of prompts after cached prefixes of different lengths (`starts`), right-padded to one length: each
    row equals attention in float64 from its own start, and equals itself prefilled alone, bitwise."""
    q, k, v = inputs(3, 6, 2, 40, 130, 16, seed=2)
    starts = torch.tensor([90, 0, 57])  # row 0 ends at the keys' end; row 1 is a whole prompt; row 2 is padded
    out = cpu_kernels.prefill_attention(q, k, v, True, starts=starts, isa=isa)
    torch.testing.assert_close(out.double(), reference_from(q, k, v, starts), atol=2e-6, rtol=1e-5)
    for b in range(3):
        alone = cpu_kernels.prefill_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], True, starts=starts[b:b + 1], isa=isa)
        assert torch.equal(alone, out[b:b + 1])
    assert torch.equal(out[:1], cpu_kernels.prefill_attention(q[:1], k[:1], v[:1], True, isa=isa))  # the default
    with pytest.raises(RuntimeError, match="not a position"):
        cpu_kernels.prefill_attention(q, k, v, True, starts=torch.tensor([0, 130, 0]), isa=isa)
