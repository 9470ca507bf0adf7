"""int8 and int4 linear layers where their options meet shapes and inputs the module tests leave at one default:
each `--int8-activations` scheme (and `full` on our exact kernel) against a plain PyTorch statement of its integer
maths, on in-features that are not multiples of 32 and rows far from zero; int4 layers whose in- and out-features
are off both the group size and the packed layout's tiles, under each group size; int4 codes as the nearest of
the levels their stored (bfloat16) scale and zero encode; strided rows (a (batch, time, features) tensor's last
position, as an output layer is handed it); and the name of the kernels' build, which must follow every file
compiled into it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.packed_linear import PackedLinear
from tserve.model.quantize import Int4Linear, Int8Linear, _int4_groups

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

# (name, activations, exact): `full` where this CPU's kernel takes it, and on our exact kernel (as on AVX2-only CPUs).
SCHEMES = [("full", "full", None), ("full-exact", "full", True), ("split", "split", None), ("7bit", "7bit", None),
           ("7bit-weights", "7bit-weights", None)]
# The largest activation code of each scheme: 8 bits, 7 bits, and split's 14-bit code (127 x 128, a row's maximum).
TOP_CODE = {"full": 255, "7bit-weights": 255, "7bit": 127, "split": 127 * 128}


def _layer(linear: nn.Linear, activations: str, exact: bool | None) -> Int8Linear:
    if exact and not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built (no compiler)")
    return Int8Linear(linear, activations, exact=exact)


def _int8_statement(linear: nn.Linear, activations: str, rows: torch.Tensor) -> torch.Tensor:
    """The int8 layer's maths in float64: weights on 127 (63 for `7bit-weights`) levels a side with one scale per
    output, each row mapped onto [0, 1] between its own extremes and coded on the scheme's levels, the integer
    product scaled back, and each row's minimum restored through the quantized weight's row sums."""
    w = linear.weight.detach().double()
    w_scale = (w.abs().amax(dim=1) / (63 if activations == "7bit-weights" else 127)).clamp_min(1e-12)
    w_codes = torch.round(w / w_scale[:, None])
    # Each row's extremes and codes as the layer maps the float32 rows (a code a hair from a tie rounds alike).
    low = rows.amin(dim=1, keepdim=True)
    span = (rows.amax(dim=1, keepdim=True) - low).clamp_min(1e-12)
    top = TOP_CODE[activations]
    codes = torch.round((rows - low) * (top / span)) if activations == "split" else torch.round((rows - low) / span * top)
    low, span = low.double(), span.double()
    out = (codes.double() @ w_codes.T) * (span / top) * w_scale + low * (w_codes * w_scale[:, None]).sum(dim=1)
    return out if linear.bias is None else out + linear.bias.double()


@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(37, 21, True), (100, 72, False), (200, 48, True)])
@pytest.mark.parametrize(("name", "activations", "exact"), SCHEMES, ids=[s[0] for s in SCHEMES])
def test_each_int8_scheme_computes_its_integer_maths_on_odd_widths_and_offset_rows(
        name, activations, exact, in_features, out_features, bias):
    """Every scheme, on widths off the kernels' 32/64 steps and rows whose minimum is far from zero (the row sums
    restore it), equals its statement to well under one activation code's step (measured: 0.05 of one at most);
    a scheme on fewer activation levels (an 8-bit GEMM fed split's 7-bit halves: hundreds of steps, 7-bit
    activations for `7bit-weights`: 6-16) or row sums of the float weight is off by several. A row alone equals it
    in the batch."""
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    layer = _layer(linear, activations, exact)
    rows = torch.randn(9, in_features) * torch.rand(9, 1) * 3 + torch.linspace(-4, 4, 9)[:, None]
    with torch.inference_mode():
        got = layer(rows)
        for i in range(len(rows)):
            assert torch.equal(layer(rows[i : i + 1]), got[i : i + 1]), i
    expected = _int8_statement(linear, activations, rows)
    # A unit step of one activation code moves a row's output by about |w| span / top: the scale of the bound.
    step = (linear.weight.detach().double().abs().amax() * (rows.amax(1) - rows.amin(1)).double() / TOP_CODE[activations])
    error = ((got.double() - expected).abs().amax(dim=1) / step)
    assert error.max() < 0.5, (name, error)


def _int4_statement(linear: nn.Linear, group_size: int, rows: torch.Tensor) -> torch.Tensor:
    """Group-wise int4 in plain PyTorch: the weight padded with zeros to whole groups, each group's codes decoded as
    (code - 8) x scale + zero, bfloat16 activations; the padding dropped."""
    weight = linear.weight.detach().float()
    k_pad = -linear.in_features % group_size
    codes, scales, zeros = _int4_groups(nn.functional.pad(weight, (0, k_pad)), group_size)
    out_f, k = codes.shape
    decoded = ((codes.view(out_f, -1, group_size).float() - 8) * scales[..., None] + zeros[..., None]).view(out_f, k)
    x = nn.functional.pad(rows.bfloat16().float(), (0, k_pad))
    out = x @ decoded.T
    return out if linear.bias is None else out + linear.bias.detach()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize(("in_features", "out_features"), [(40, 20), (72, 36), (136, 24), (200, 8)])
def test_an_int4_layer_off_the_groups_and_tiles_computes_its_codes_maths(group_size, in_features, out_features):
    """In-features off every group size (padded with zero weights to whole groups, the input with zeros) and
    out-features off the packed layout's tiles of 16 (the extra outputs dropped): the layer equals the statement
    of its codes to bfloat16's rounding, stays near the float weights, and a row alone equals it in the batch."""
    torch.manual_seed(in_features + out_features)
    linear = nn.Linear(in_features, out_features)
    layer = Int4Linear(linear, group_size)
    rows = torch.randn(6, in_features) + 0.5
    with torch.inference_mode():
        got = layer(rows)
        for i in range(len(rows)):
            assert torch.equal(layer(rows[i : i + 1]), got[i : i + 1]), i
        reference = linear(rows)
    assert got.shape == (6, out_features)
    torch.testing.assert_close(got, _int4_statement(linear, group_size, rows), rtol=1e-2, atol=1e-2)
    assert ((got - reference).norm() / reference.norm()) < 0.1  # 16 levels a group


def test_int4_codes_are_the_nearest_of_the_levels_their_stored_scale_and_zero_encode():
    """Scales and zeros are stored in bfloat16; each weight's code must be chosen against those rounded values, so
    that it decodes to the nearest of its group's 16 levels (choosing them before the rounding shifts every level
    of a group by the zero's rounding, and the weights near a midpoint take the farther level)."""
    torch.manual_seed(0)
    weight = torch.randn(128, 256) + 3.0  # zeros far from 0: their bfloat16 rounding is large
    codes, scales, zeros = _int4_groups(weight, 32)
    groups = weight.view(128, 8, 32)
    levels = (torch.arange(16).float() - 8) * scales[..., None] + zeros[..., None]  # (out, groups, 16)
    distances = (groups[..., None] - levels[:, :, None, :]).abs()  # (out, groups, 32, 16)
    chosen = distances.gather(-1, codes.view(128, 8, 32, 1).long()).squeeze(-1)
    nearest = distances.amin(dim=-1)
    assert (chosen - nearest).max() < 1e-5 * weight.abs().max()


def _strided_rows(in_features: int) -> torch.Tensor:
    """The last position of a (batch, time, features) tensor: rows that are a view with a stride of time x
    features, as an output layer is handed them."""
    torch.manual_seed(1)
    hidden = torch.randn(3, 5, in_features) + 1.0
    rows = hidden[:, -1]
    assert not rows.is_contiguous()
    return rows


@pytest.mark.parametrize(("name", "activations", "exact"), SCHEMES, ids=[s[0] for s in SCHEMES])
def test_an_int8_layer_takes_strided_rows(name, activations, exact):
    """Each scheme on our row kernels (and `full` on our exact GEMM) takes rows that are a strided view, with the
    values it gives the same rows laid out contiguously."""
    layer = _layer(nn.Linear(72, 40), activations, exact)
    rows = _strided_rows(72)
    with torch.inference_mode():
        assert torch.equal(layer(rows), layer(rows.contiguous()))


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_and_packed_layers_take_strided_rows(group_size):
    """The int4 layer and the pre-packed float32 one take strided rows as they take contiguous ones."""
    torch.manual_seed(2)
    linear = nn.Linear(96, 40)
    rows = _strided_rows(96)
    with torch.inference_mode():
        for layer in (Int4Linear(linear, group_size), PackedLinear(linear)):
            assert torch.equal(layer(rows), layer(rows.contiguous())), type(layer).__name__


def test_the_kernels_build_is_named_by_its_headers_too(tmp_path, monkeypatch):
    """A build that is there is imported as it is (no rebuild): its name must change with every file compiled into
    it, the headers the sources include as well as the sources, or an edited header would be served from the stale
    build (differently from the sources beside it)."""
    header = tmp_path / "vector_math.h"
    header.write_text(cpu_kernels._HEADERS[0].read_text())
    monkeypatch.setattr(cpu_kernels, "_HEADERS", [header])
    flags = cpu_kernels._flags()
    before = cpu_kernels._build_name(flags)
    assert cpu_kernels._build_name(flags) == before
    header.write_text(header.read_text() + "\n// an edited inline function\n")
    assert cpu_kernels._build_name(flags) != before
