"""Weight formats (`--quantize int8 / int4 / q8_0 / q4_0`) beside the features whose tests mostly run float32:
block layers whose widths are not whole blocks of 32 (their inputs padded), on the layers' own path (prefill) and
in the fused decode step of several rows; the logit lens of a quantized model whose output layer is tied to its
embedding; and what a quantized model holds, as `--max-model-memory` counts it, whichever kernel holds the weights.

References: our own codes and scales in plain PyTorch (`block_quant.reference_linear`), the layer-by-layer path
of the same quantized model, the model's own forward, and the bytes a weight of each format takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.model.test_fused_decode import paged_cache
from tests.model.test_option_combinations_models import _behaving
from tserve.model import logit_lens as lens
from tserve.model import quantize
from tserve.model.block_quant import BlockLinear, reference_linear
from tserve.model.checkpoint import load, weight_bytes
from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.model.fused_decode import FusedDecode
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.layers import fuse_gated_mlps
from tserve.model.quantize import Int4Linear, Int8Linear, held_bytes, quantize_blocks

pytestmark = pytest.mark.kernels  # quantized products: their values follow the CPU's kernels

ISAS = cpu_kernels.extension().block_isas() if cpu_kernels.available() else []
PATHS = [None, *ISAS]  # None: the PyTorch statement; else our kernels' instruction sets
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


# ------------------------------------------------------------------------------------------------------------
# Widths that are not whole blocks of 32
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", PATHS, ids=[p or "pytorch" for p in PATHS])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("in_features", [40, 80])
def test_a_block_layer_narrower_than_whole_blocks_pads_its_inputs_after_them(in_features, fmt, isa):
    """A layer of 40 or 80 inputs holds blocks of 48 or 96 weights, the last 8 or 16 zero: each row's inputs are
    padded the same way, at the end, so the product is our codes' statement on the padded rows bit for bit, and
    near the float layer's (inputs padded at the front would meet the weights of other inputs)."""
    torch.manual_seed(3)
    linear = nn.Linear(in_features, 24)
    layer = BlockLinear(linear, fmt, isa=isa)
    x = torch.randn(7, in_features)
    codes, scales = layer.plain()
    padded = F.pad(x, (0, codes.size(1) - in_features))
    assert torch.equal(layer(x), reference_linear(padded, codes, scales, layer.bias, fmt))
    exact = linear(x).detach()
    tolerance = 0.03 if fmt == "q8_0" else 0.2
    assert (layer(x) - exact).norm() < tolerance * exact.norm()


def _narrow_decoder(fmt: str) -> Decoder:
    """A Llama-layout model 48 wide with an MLP of 80 (neither whole blocks of 32), weights large enough that every
    layer moves the residual stream, its linear layers in `fmt` blocks."""
    cfg = DecoderConfig(vocab_size=97, d_model=48, n_heads=3, n_kv_heads=1, n_layers=2, d_ff=80, max_seq_len=64,
                        norm="rmsnorm", activation="swiglu", positions="rope", bias=False)
    model = _behaving(cfg, seed=5)
    fuse_gated_mlps(model)
    quantize_blocks(model, fmt)
    return model


def _steps(model: Decoder, fused: FusedDecode | None, prompts: list[list[int]], new: int) -> list[torch.Tensor]:
    """Each decode step's logits (rows, V) after prefilling `prompts` together, fed tokens that depend on the step
    only (both paths see the same inputs)."""
    model.fused = fused
    cache = paged_cache(model, len(prompts), seed=2)
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    slots = torch.arange(len(prompts))
    model.prefill(tokens, lengths, cache, slots)
    positions, out = lengths.clone(), []
    for step in range(new):
        out.append(model.decode_step((positions * 7 + step * 13 + slots * 5) % 97, positions, cache, slots))
        positions += 1
    return out


@pytest.mark.skipif(not ISAS, reason="no fused decode step without the block kernels")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_fused_steps_of_several_rows_on_widths_off_the_blocks_equal_the_layers_steps(fmt):
    """The fused step pads each row of a product whose inputs are not whole blocks (48 and 80 here) before the
    block kernel reads it: three rows decoded together give the layer-by-layer path's logits within the block
    formats' rounding (an activation code may move by one step) and its greedy tokens, in every row, not the
    first only."""
    model = _narrow_decoder(fmt)
    fused = FusedDecode.build(model)
    assert fused is not None
    prompts = [[5, 17, 3], [40, 2, 9, 11, 60, 8, 1], [88]]
    layered, one_call = _steps(model, None, prompts, 6), _steps(model, fused, prompts, 6)
    for step, (a, b) in enumerate(zip(layered, one_call, strict=True)):
        assert a.abs().max() > 1.0, "a model whose logits are all near zero compares nothing"
        assert torch.equal(b.argmax(-1), a.argmax(-1)), f"step {step}: another greedy token"
        assert (b - a).abs().max() < 0.15, f"step {step}"


# ------------------------------------------------------------------------------------------------------------
# The logit lens of a quantized model with a tied output layer
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized_lms(tiny_lm):
    return {fmt: load(tiny_lm, quantize=fmt) for fmt in ("int8", "int4", "q8_0", "q4_0")}


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_0"])
def test_the_last_lens_layer_of_a_quantized_tied_model_is_its_own_prediction(quantized_lms, fmt):
    """The tiny LM ties its output layer to its embedding; quantized, the output layer holds its own quantized
    copy, which the model predicts with. The lens after the last layer goes through that same output layer: its
    top tokens and probabilities are the model's own next-token distribution at every position (not the float
    embedding's, which a quantized model never uses)."""
    loaded = quantized_lms[fmt]
    assert loaded.config.tie_embeddings and loaded.quantization == fmt
    ids = [1, 17, 30, 8, 44, 12, 5]
    last = lens.n_layers(loaded) - 1
    (got,) = lens.logit_lens(loaded, ids, [last], top_k=5)
    with torch.inference_mode():
        probs = torch.softmax(loaded.model(torch.tensor([ids]))[0].float(), dim=-1)
    values, top = torch.topk(probs, k=5, dim=-1)
    assert got.top_ids == top.tolist()
    torch.testing.assert_close(torch.tensor(got.top_probs), values, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# What a quantized model holds (--max-model-memory)
# ------------------------------------------------------------------------------------------------------------
def _bytes_per_weight(layer: nn.Module) -> float:
    return held_bytes(layer) / (layer.in_features * layer.out_features)


# Bytes a weight takes in each kind of layer, with its scales, row sums and bias (layers of 64 inputs and more):
# int8 one byte a weight, int4 and Q4_0 half a byte, plus their scales; never a weight counted twice or left out.
BOUNDS = {"int8": (1.0, 1.5), "int4": (0.5, 0.9), "q8_0": (1.0, 1.3), "q4_0": (0.5, 0.8)}


def _kind(layer: nn.Module) -> str | None:
    if isinstance(layer, Int8Linear):
        return "int8"
    if isinstance(layer, Int4Linear):
        return "int4"
    return layer.fmt if isinstance(layer, BlockLinear) else None


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_0"])
def test_a_quantized_model_holds_each_weight_once_in_its_formats_bytes(quantized_lms, fmt):
    """--max-model-memory adds up what each served model holds (`held_bytes`): int4's packed weights and scales,
    the blocks' codes, int8's weights wherever its kernel keeps them. Each quantized layer counts its format's
    bytes a weight, and the model at least the sum of its layers and its float embedding."""
    model = quantized_lms[fmt].model
    layers = [m for m in model.modules() if _kind(m) is not None]
    assert layers
    for layer in layers:
        low, high = BOUNDS[_kind(layer)]
        assert low <= _bytes_per_weight(layer) <= high, (layer, _bytes_per_weight(layer))
    embedding = model.tok_emb.weight
    assert held_bytes(model) >= sum(held_bytes(m) for m in layers) + embedding.numel() * embedding.element_size()


@pytest.mark.skipif(not cpu_kernels.available(), reason="the exact int8 kernel is not built")
@pytest.mark.parametrize("exact", [False, True], ids=["pytorch-engine", "exact-kernel"])
def test_an_int8_layer_holds_its_weights_once_on_either_kernel(exact):
    """`full` activations run on PyTorch's int8 engine (weights in the engine's own object) or on our exact kernel
    (weights in its panels, a buffer) as the CPU decides (`make test-avx2` takes the exact one): either way a
    weight is one byte of what the layer holds, counted once."""
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(128, 96), "full", exact=exact)
    assert layer.exact == exact
    low, high = BOUNDS["int8"]
    assert low <= _bytes_per_weight(layer) <= high, _bytes_per_weight(layer)


# (model, --quantize, --int8-activations, kernel): a tied decoder, an untied Llama with a gated MLP and rope tables,
# a translator; int8 on PyTorch's engine and, forced, on our exact kernel (the layer of an AVX2-only CPU).
ESTIMATED = [(model, fmt, "auto", None) for model in ("tiny-lm", "hf-llama", "tiny-mt")
             for fmt in ("int8", "int4", "q8_0", "q4_0")] + [
    ("tiny-lm", "int8", "7bit", None), ("hf-llama", "int8", "full", "exact"), ("hf-llama", "q4_0", "auto", None)]


@pytest.mark.parametrize(("model", "fmt", "activations", "kernel"), ESTIMATED,
                         ids=["-".join(filter(None, case)) for case in ESTIMATED])
def test_the_memory_estimate_of_a_quantized_load_is_what_the_loaded_model_holds(monkeypatch, model, fmt,
                                                                                 activations, kernel):
    """--max-model-memory checks a load from the checkpoint's headers before any weight is read
    (`checkpoint.weight_bytes`, told the quantization): what the model then holds once quantized (`held_bytes`),
    to the byte, less only the tables it computes from its config (rope, positions), which the float estimate
    leaves out too. Well under its float32 weights."""
    if kernel == "exact":
        if not cpu_kernels.available():
            pytest.skip("the exact int8 kernel is not built")
        monkeypatch.setattr(quantize, "full_activations_kernel", lambda: "exact")
    path = FIXTURES / model
    tables = held_bytes(load(path).model) - weight_bytes(path, torch.float32)
    loaded = load(path, quantize=fmt, int8_activations=activations)
    if kernel == "exact":
        assert all(m.exact for m in loaded.model.modules() if isinstance(m, Int8Linear))
    estimate = weight_bytes(path, torch.float32, fmt, activations)
    assert estimate + tables == held_bytes(loaded.model)
    assert estimate < 0.8 * weight_bytes(path, torch.float32)


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_0"])
def test_a_quantized_layer_of_widths_its_kernel_pads_holds_what_its_formats_rule_counts(fmt):
    """97 outputs and 40 inputs (neither whole panels of 16 nor whole groups or blocks of 32): the rule the
    --max-model-memory estimate counts a layer by (`quantize.quantized_layer_bytes`) is what the layer holds,
    padding included, besides its float32 bias."""
    torch.manual_seed(0)
    linear = nn.Linear(40, 97)
    layer = {"int8": lambda: Int8Linear(linear, quantize.resolve_activations("auto")),
             "int4": lambda: Int4Linear(linear, 32)}.get(fmt, lambda: BlockLinear(linear, fmt))()
    assert quantize.quantized_layer_bytes(fmt, 97, 40) + 97 * 4 == held_bytes(layer)
