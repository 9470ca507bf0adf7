"""Our exact int8 GEMM (tserve/model/kernels/int8_gemm.cpp): what `--int8-activations full` runs on a CPU whose PyTorch
int8 kernel would overflow with 8-bit activations (AVX2 without VNNI). Its integer sums are exact where
`vpmaddubsw`'s int16 pairs saturate, every row's result is its own (alone = in any batch, bitwise), the layer
equals its statement as PyTorch calls bit for bit. (That `auto` picks it there: tests/model/test_quantize.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.quantize import Int8Linear, _quantize_weight

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built (no compiler)")]


def _pieces(weight: torch.Tensor, bias: torch.Tensor | None):  # noqa: ANN202
    """What `Int8Linear` hands the kernel for this float weight: panels, coefficients, row sums, bias."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    q = _quantize_weight(weight, scales)
    ext = cpu_kernels.extension()
    return ext.int8_pack_panels(q.int_repr()), (scales / 255).float(), q.dequantize().sum(dim=1), bias


def test_sums_past_int16_are_exact():
    """Codes of 255 against weights of +-127: every pair of products sums to +-64,770, twice what an int16
    holds (a saturating kernel gives 32,767 a pair). The output must be the exact sum, scaled."""
    k, n = 1024, 40
    weight = torch.ones(n, k)
    weight[1::2] = -1.0  # odd columns negative: saturation at both ends
    panels, coefficients, row_sums, _ = _pieces(weight, None)
    x = torch.ones(3, k)
    x[:, -1] = 0.0  # each row's minimum: codes 255 everywhere else, 0 here
    out = cpu_kernels.extension().int8_linear_exact(x, panels, coefficients, row_sums, None)
    expected = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0) * (k - 1)  # x W^T, exact in float32
    torch.testing.assert_close(out, expected.expand(3, n), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("k", "n"), [(512, 2048), (2048, 512), (37, 21), (1, 16), (64, 17)])
def test_every_row_is_its_own_and_close_to_float(k, n):
    """Rows 1..13 (every tile height, and a partial one), odd in-features, out-features off the 16-column
    panels: each row alone equals it in the batch bit for bit, and the layer stays within 8-bit's error."""
    torch.manual_seed(k + n)
    linear = nn.Linear(k, n)
    pieces = _pieces(linear.weight.detach(), linear.bias.detach())
    ext = cpu_kernels.extension()
    x = torch.randn(13, k) * torch.rand(13, 1) * 4
    batch = ext.int8_linear_exact(x, *pieces)
    for rows in range(1, 14):
        assert torch.equal(ext.int8_linear_exact(x[:rows].contiguous(), *pieces), batch[:rows]), rows
    for i in range(13):
        assert torch.equal(ext.int8_linear_exact(x[i : i + 1].contiguous(), *pieces), batch[i : i + 1]), i
    with torch.inference_mode():
        ref = linear(x)
    if k > 1:  # one input feature: each row is constant, nothing to quantize
        error = (batch - ref).norm(dim=1) / (ref - linear.bias).norm(dim=1)
        assert error.max() < 0.03, error


def test_a_layer_on_the_exact_kernel_equals_its_pytorch_statement():
    """`Int8Linear` on our kernel (forced here as on a CPU without VNNI) equals `_forward_in_steps`'s PyTorch
    calls (exact integer products in float64, one rounding) bit for bit, with and without bias, a constant row
    among them; its int8 weight unpacks from the panels unchanged."""
    torch.manual_seed(3)
    for k, n, bias in ((512, 1536, True), (2048, 512, False), (37, 21, True)):
        linear = nn.Linear(k, n, bias=bias)
        layer = Int8Linear(linear, "full", exact=True)
        reference = Int8Linear(linear, "7bit")  # PyTorch's packing of the same int8 weight
        assert torch.equal(layer.int8_weight(), reference.int8_weight())
        for rows in (1, 7, 32):
            x = torch.randn(rows, k) * torch.rand(rows, 1) * 3
            x[-1] = 0.25
            with torch.inference_mode():
                assert torch.equal(layer(x), layer._forward_in_steps(x)), (k, rows)
                assert torch.equal(layer(x.view(1, rows, k)), layer(x).view(1, rows, n))  # (B, T, C) rows too


def test_a_layer_on_the_exact_kernel_takes_rows_that_are_not_float32():
    """The kernel takes float32 rows; others (float64 here) get the layer's PyTorch statement, which agrees
    with the kernel's float32 result to within float32's rounding of the input."""
    torch.manual_seed(4)
    linear = nn.Linear(64, 48)
    layer = Int8Linear(linear, "full", exact=True)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        wide, narrow = layer(x.double()), layer(x)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide.float(), narrow, rtol=0, atol=1e-3 * narrow.abs().max().item())


def test_the_kernels_run_on_pytorchs_threads():
    """The kernels' parallel loops (decode attention, the int8 row mapping, this GEMM) run on as many threads as
    PyTorch is given: 2 when it has 2, 1 when it has 1 (`at::parallel_for` compiled without OpenMP runs on one,
    whatever PyTorch has)."""
    ext, before = cpu_kernels.extension(), torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert ext.parallel_threads(64) == threads
    finally:
        torch.set_num_threads(before)
