"""`quantize="int4"` (`--quantize int4`): every linear layer of each model kind holds group-wise int4 weights,
about an eighth of the float32 bytes, except the output (vocabulary) layer, which holds int8 ones; a layer
computes exactly what its codes, scales and zeros encode, a row is the same alone and in any batch. On the
bundled models' test splits perplexity and chrF move only within stated bounds: those tests are in
test_quantize.py, beside int8's on the same splits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.model.test_quantize import _logits
from tserve.model.checkpoint import load
from tserve.model.quantize import (
    INT4_GROUP_SIZES,
    OUTPUT_LAYER,
    Int4Linear,
    Int8Linear,
    _int4_groups,
    linear_weight_bytes,
    quantize_int4,
)

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("which", ["lm", "mt", "vit"])
def test_every_linear_layer_holds_int4_weights_but_the_output_layer_int8(which, tiny_lm, tiny_mt, tiny_vit):
    """The language model's and the translator's output (vocabulary) layer is int8, every other linear layer
    int4 (the classifier has no vocabulary layer: all int4)."""
    path = {"lm": tiny_lm, "mt": tiny_mt, "vit": tiny_vit}[which]
    fp32, int4 = load(path), load(path, quantize="int4")
    assert int4.quantization == "int4"
    float_linears = sum(isinstance(m, nn.Linear) for m in fp32.model.modules())
    assert not any(isinstance(m, nn.Linear) for m in int4.model.modules())  # none left in float
    output = getattr(int4.model, OUTPUT_LAYER, None)
    assert (output is not None) == (which != "vit")
    assert output is None or isinstance(output, Int8Linear)
    int4_layers = sum(isinstance(m, Int4Linear) for m in int4.model.modules())
    assert int4_layers == float_linears - (output is not None) > 0
    assert sum(isinstance(m, Int8Linear) for m in int4.model.modules()) == (output is not None)
    # Half a byte a weight, 4 bytes of scale and zero per 32; padding to the packed layout and the int8 output
    # layer (a byte a weight) add a little.
    assert linear_weight_bytes(fp32.model) / 8 < linear_weight_bytes(int4.model) < linear_weight_bytes(fp32.model) / 5
    ref, got = _logits(fp32, which), _logits(int4, which)
    assert not torch.equal(ref, got)
    assert (got - ref).abs().max() < 0.1 * (ref.max() - ref.min())


@pytest.mark.parametrize(("in_features", "out_features", "group_size"), [(64, 48, 32), (96, 40, 64), (256, 16, 128)])
def test_an_int4_layer_computes_the_weight_its_codes_encode(in_features, out_features, group_size):
    """Sizes the packed layout does not take (outputs not a multiple of 16, inputs not of the group) are padded;
    the result is bfloat16 activations times the dequantized weight, plus the bias, to bfloat16 rounding."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features)
    layer = Int4Linear(linear, group_size)
    weight = layer.dequantized_weight()
    assert weight.shape == linear.weight.shape
    assert (weight - linear.weight).norm() / linear.weight.norm() < 0.1  # 16 levels a group
    x = torch.randn(7, in_features)
    with torch.inference_mode():
        got = layer(x)
        expected = x.bfloat16().float() @ weight.t() + linear.bias
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_an_int4_row_is_the_same_alone_and_in_any_batch():
    torch.manual_seed(0)
    layer = Int4Linear(nn.Linear(128, 96), 32)
    rows = torch.randn(37, 128)
    rows[3] *= 1e3
    with torch.inference_mode():
        batch = layer(rows)
        for start, size in ((0, 1), (5, 1), (3, 4), (10, 17), (36, 1)):
            assert torch.equal(layer(rows[start : start + size]), batch[start : start + size])
        assert torch.equal(layer(rows.view(1, 37, 128)), batch.view(1, 37, 96))


def test_int4_codes_are_fitted_not_only_spread_between_the_extremes():
    """Least squares on the codes: less error than 16 levels from each group's minimum to its maximum
    (Gaussian weights: 7.4% against 7.8%)."""
    torch.manual_seed(0)
    weight = torch.randn(256, 512)
    codes, scales, zeros = _int4_groups(weight, 32)
    assert codes.min() >= 0 and codes.max() <= 15
    decoded = ((codes.view(256, 16, 32).float() - 8) * scales[..., None] + zeros[..., None]).view(256, 512)
    groups = weight.view(256, 16, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    spread = (((groups - low) / step).round() * step + low).view(256, 512)
    fitted_error, spread_error = ((decoded - weight).norm() / weight.norm()).item(), \
        ((spread - weight).norm() / weight.norm()).item()
    assert fitted_error < 0.076 < spread_error, (fitted_error, spread_error)


def test_int4_settings_are_checked(tiny_lm):
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        load(tiny_lm, dtype="bfloat16", quantize="int4")
    with pytest.raises(ValueError, match="group size"):
        load(tiny_lm, quantize="int4", int4_group_size=48)
    assert INT4_GROUP_SIZES == (32, 64, 128)
    model = load(tiny_lm, quantize="int4", int4_group_size=128).model
    assert {m.group_size for m in model.modules() if isinstance(m, Int4Linear)} == {128}
    with pytest.raises(ValueError):
        quantize_int4(load(tiny_lm).model.to(torch.bfloat16))
