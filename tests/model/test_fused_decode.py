"""One-token decode steps through every layer in one C++ call (`model.fused_decode`, `--fused-layers`) against the
same model's layer-by-layer steps: each family's layout (Llama with grouped kv heads, Qwen2's q/k/v biases, Qwen3's
q/k norms, GPT-2, fixed sinusoidal positions, Gemma 3's offset norms, sandwich norms, attention scale, sliding
layers with their own rope base, partial rotary, layers without positions, a residual multiplier), on float32,
pre-packed float32, Q8_0 and Q4_0 weights, several rows of different lengths on shuffled blocks, a window shorter
than the rows."""

from __future__ import annotations

import pytest
import torch

from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.model.fused_decode import FusedDecode
from tserve.model.layers import fuse_gated_mlps, set_attention_backend
from tserve.model.packed_linear import PackedLinear, pack_linears
from tserve.model.quantize import quantize_blocks, quantize_int8

pytestmark = pytest.mark.kernels

COMMON = dict(vocab_size=97, d_model=64, n_heads=4, n_layers=3, d_ff=128, max_seq_len=64)
LAYOUTS = {
    "llama": dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False, n_kv_heads=2),
    "qwen2": dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False, qkv_bias=True, n_kv_heads=1),
    "qwen3": dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False, qk_norm=True, n_kv_heads=2,
                  head_dim=32),
    "gpt2": dict(norm="layernorm", activation="gelu_tanh", positions="learned", bias=True),
    "sinusoidal": dict(norm="layernorm", activation="gelu", positions="sinusoidal", bias=True),
    "gemma3": dict(norm="rmsnorm", norm_weight_offset=1.0, activation="gated_gelu_tanh", positions="rope", bias=False,
                   sandwich_norms=True, qk_norm=True, attention_scale=0.2, sliding_window=5, sliding_layers=[0, 2],
                   local_rope_base=1000.0, scale_embeddings=True, n_kv_heads=1),
    "phi3-smollm3-granite": dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False, rotary_dim=8,
                                 nope_layers=[1], residual_multiplier=0.7, sliding_window=6, sliding_layers=[0, 1, 2]),
}
FORMATS = ("float32", "packed", "q8_0", "q4_0")


def behaving(layout: str, seed: int) -> Decoder:
    """A model whose outputs depend on the whole input: weights large enough that every layer moves the residual
    stream, norms away from one."""
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(**COMMON, **LAYOUTS[layout]), backend="cpu-decode").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand_like(p) * 0.5 + (0.25 if model.cfg.norm_weight_offset else 0.75))
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.05)
    return model


def served(layout: str, fmt: str, seed: int = 0) -> Decoder:
    model = behaving(layout, seed)
    fuse_gated_mlps(model)
    if fmt == "packed":
        assert pack_linears(model) > 0
    elif fmt != "float32":
        quantize_blocks(model, fmt)
    return model


def paged_cache(model: Decoder, rows: int, seed: int):  # noqa: ANN201
    """A pool of small blocks, each row's table shuffled through it."""
    cache = model.new_cache(rows, 32, num_blocks=1 + rows * 8, block_size=4)
    order = (1 + torch.randperm(rows * 8, generator=torch.Generator().manual_seed(seed))).view(rows, 8)
    cache.set_tables(list(range(rows)), order.tolist())
    return cache


def steps(model: Decoder, fused: FusedDecode | None, prompts: list[list[int]], new: int) -> list[torch.Tensor]:
    """Each step's logits (rows, V) after prefilling `prompts`, feeding the layer-by-layer path's greedy tokens
    (fixed per row, so both paths see the same inputs): the tokens come from a function of the step, not the
    logits."""
    model.fused = fused
    cache = paged_cache(model, len(prompts), seed=1)
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    slots = torch.arange(len(prompts))
    out = [model.prefill(tokens, lengths, cache, slots)]
    positions = lengths.clone()
    for step in range(new):
        next_tokens = (positions * 7 + step * 13 + slots * 5) % model.cfg.vocab_size
        out.append(model.decode_step(next_tokens, positions, cache, slots))
        positions += 1
    return out


PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60, 8, 1, 33, 21, 7, 50], [88]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fused_steps_equal_the_layers_steps(layout, fmt):
    """Rows of 1, 3 and 11 tokens, 9 steps each (past the 5- and 6-position windows), logits within float32
    rounding of the layer-by-layer path's: the products are the same kernels on the same inputs, a norm's sum
    adds in another order."""
    model = served(layout, fmt)
    fused = FusedDecode.build(model)
    assert fused is not None
    layered = steps(model, None, PROMPTS, 9)
    one_call = steps(model, fused, PROMPTS, 9)
    # The block formats quantize each product's input: a rounding difference in a norm can move one activation
    # code by one step (1/127 of its block's largest value) and the logits after it by up to a few hundredths;
    # the rest stay within float32 rounding.
    for step, (a, b) in enumerate(zip(layered[1:], one_call[1:], strict=True)):
        assert a.abs().max() > 2.0, "a model whose logits are all near zero compares nothing"
        assert torch.equal(b.argmax(-1), a.argmax(-1)), f"step {step}: another greedy token"
        if fmt in ("float32", "packed"):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
        else:
            assert (b - a).abs().max() < 0.15, f"step {step}"
    if fmt not in ("float32", "packed"):
        close = [((b - a).abs() <= 1e-4 + 1e-4 * a.abs()).float().mean() for a, b in zip(layered, one_call, strict=True)]
        assert sum(close) / len(close) > 0.8


@pytest.mark.parametrize("fmt", ["packed", "q8_0", "q4_0"])
def test_a_row_alone_equals_the_row_in_a_batch(fmt):
    """From one cache state, a row's fused step alone and beside two others give the same logits, bit for bit:
    its products and attention are its own (float32 as served: pre-packed; `F.linear` changes kernels by rows)."""
    model = served("llama", fmt)
    cache = paged_cache(model, 3, seed=2)
    tokens = torch.tensor([[5, 17, 3, 0], [40, 2, 9, 11], [88, 0, 0, 0]])
    lengths = torch.tensor([3, 4, 1])
    model.prefill(tokens, lengths, cache, torch.arange(3))
    k, v = cache.k.clone(), cache.v.clone()
    model.fused = FusedDecode.build(model)
    batch = model.decode_step(torch.tensor([7, 8, 9]), lengths, cache, torch.arange(3))
    cache.k.copy_(k)
    cache.v.copy_(v)
    alone = model.decode_step(torch.tensor([8]), lengths[1:2], cache, torch.tensor([1]))
    assert torch.equal(alone[0], batch[1])


def test_layouts_the_kernel_does_not_compute_keep_the_layers():
    """Soft-capped attention (Gemma 2), post-norm blocks, int8 layers and another attention backend are not
    fused: the layer-by-layer path serves them."""
    capped = Decoder(DecoderConfig(**COMMON, **LAYOUTS["llama"], attention_softcap=50.0), backend="cpu-decode")
    assert FusedDecode.build(capped.eval()) is None
    post = Decoder(DecoderConfig(**COMMON, norm_placement="post"), backend="cpu-decode")
    assert FusedDecode.build(post.eval()) is None
    int8 = behaving("llama", 0)
    fuse_gated_mlps(int8)
    quantize_int8(int8, "split")
    assert FusedDecode.build(int8) is None
    sdpa = served("llama", "float32")
    sdpa.blocks[0].attn.set_backend("sdpa")
    assert FusedDecode.build(sdpa) is None
    assert FusedDecode.build(served("llama", "packed")) is not None
    assert any(isinstance(m, PackedLinear) for m in served("gpt2", "packed").modules())


def test_without_the_kernels_the_layers_serve(monkeypatch):
    """Where the C++ kernels are not built (no compiler): nothing is fused, the layers' steps serve, and the greedy
    choice is PyTorch's argmax."""
    from tserve.model.kernels import cpu as cpu_kernels  # noqa: PLC0415

    model = served("llama", "packed")
    monkeypatch.setattr(cpu_kernels, "extension", lambda: None)
    assert FusedDecode.build(model) is None
    model.fuse_decode()
    set_attention_backend(model, "sdpa")  # what `auto` resolves to there
    assert model.fused is None and len(steps(model, None, PROMPTS[:1], 2)) == 3
    x = torch.randn(2, 10)
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1))


def _steps_from(model: Decoder, cache, state: tuple[torch.Tensor, torch.Tensor], lengths: torch.Tensor,
                threads: int, new: int) -> list[torch.Tensor]:
    """`new` fused steps of every row from the cache state `state` (its keys and values), on `threads` threads."""
    cache.k.copy_(state[0])
    cache.v.copy_(state[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        slots, positions, out = torch.arange(len(lengths)), lengths.clone(), []
        for step in range(new):
            out.append(model.decode_step((positions * 7 + step * 13 + slots * 5) % model.cfg.vocab_size, positions,
                                         cache, slots))
            positions += 1
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["float32", "q8_0", "q4_0"])
@pytest.mark.parametrize("layout", ["llama", "gemma3"])
def test_a_step_on_two_threads_equals_the_step_on_one(layout, fmt):
    """A step's loops shared by two threads held for the whole step (`kernels/step_team.h`) give the bits one thread
    gives: each kernel's result for a column, a row or a head does not depend on how its loop is split. From one
    cache state (the prompt read once, on one thread), three rows, 9 steps."""
    model = served(layout, fmt)
    cache = paged_cache(model, 3, seed=3)
    tokens = torch.tensor([[5, 17, 3, 0, 0, 0, 0], [40, 2, 9, 11, 60, 8, 1], [88, 0, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([3, 7, 1])
    model.prefill(tokens, lengths, cache, torch.arange(3))
    state = (cache.k.clone(), cache.v.clone())
    model.fused = FusedDecode.build(model)
    alone = _steps_from(model, cache, state, lengths, 1, 9)
    shared = _steps_from(model, cache, state, lengths, 2, 9)
    for step, (a, b) in enumerate(zip(alone, shared, strict=True)):
        assert a.abs().max() > 2.0, "a model whose logits are all near zero compares nothing"
        assert torch.equal(a, b), f"step {step}"


def test_an_error_inside_a_shared_step_is_raised_and_the_next_step_runs():
    """A check that fails on the step's thread while the other thread waits for loops (a block id past the cache)
    raises as it does on one thread, and leaves no thread waiting: the next step runs and gives the one-thread
    logits."""
    model = served("llama", "q8_0")
    cache = paged_cache(model, 1, seed=4)
    lengths = torch.tensor([5])
    model.prefill(torch.tensor([[3, 1, 4, 1, 5]]), lengths, cache, torch.arange(1))
    state = (cache.k.clone(), cache.v.clone())
    model.fused = FusedDecode.build(model)
    tables = cache.tables.clone()
    cache.tables[0, 1] = cache.k.shape[1] // cache.block_size + 5
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="out of range"):
            model.decode_step(torch.tensor([7]), lengths, cache, torch.arange(1))
    finally:
        torch.set_num_threads(before)
    cache.tables.copy_(tables)
    assert all(torch.equal(a, b) for a, b in zip(_steps_from(model, cache, state, lengths, 2, 3),
                                                 _steps_from(model, cache, state, lengths, 1, 3), strict=True))
