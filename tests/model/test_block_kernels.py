"""llama.cpp's Q8_0 / Q4_0 blocks (`tserve/model/block_quant.py`) and our kernels for them
(`tserve/model/kernels/block_quant.cpp`): the weights quantize as llama.cpp's reference does, every ISA path of the
kernel equals the PyTorch statement of its maths bit for bit (each number of rows of a tile, odd column counts,
partial chunks of blocks), a row's result is its own, the path follows PyTorch's own capability (AVX2 under
`tserve.testing.avx2_only`), and where the kernels cannot run the statement serves, said once in the log."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tserve.model import block_quant
from tserve.model.block_quant import (
    BlockLinear,
    pack_panels,
    quantize_activations,
    quantize_q4_0,
    quantize_q8_0,
    reference_linear,
    unpack_panels,
)
from tserve.model.checkpoint import load
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.quantize import linear_weight_bytes

pytestmark = pytest.mark.kernels  # `make test-avx2` runs the module again on AVX2-only kernels

ISAS = cpu_kernels.extension().block_isas() if cpu_kernels.available() else []
needs_isa = pytest.mark.skipif(not ISAS, reason="the block kernels do not run on this CPU")
# Every tile height of both paths (AVX-512: 1..8 rows a tile, AVX2: 1..4), several tiles, prefill.
ROW_COUNTS = (*range(1, 10), 17, 64)
# (K, N): odd column counts (a partial panel, an empty AVX2 half), a partial chunk of blocks (10 = 8 + 2).
SHAPES = ((64, 17), (320, 5), (96, 33), (768, 50))


def _inputs(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 40.0  # an outlier: its block's other codes get coarse
    x[:, 32:64] = 0.0  # a block of zeros: scale 0
    if m > 1:
        x[1, :32] = -3.0  # a constant negative block: every code -127
    return x


def _layer(k: int, n: int, fmt: str, isa: str | None, seed: int = 0, bias: bool = True) -> BlockLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight[0, :32] = 0.0  # an all-zero block
        linear.weight[1, :32] = 0.5  # a constant block: Q4_0 puts it at -8
        linear.weight[2, 64 % k:] *= 30.0
    return BlockLinear(linear, fmt, isa=isa)


def _q4_0_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's quantize_row_q4_0_ref: the block's value of largest magnitude (sign kept) onto code 0."""
    blocks = w.reshape(w.size(0), -1, 32)
    d = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -8.0
    codes = (blocks / torch.where(d != 0, d, torch.ones_like(d))).add(8.5).trunc().clamp(0, 15).to(torch.uint8)
    return codes.reshape(w.shape), d.squeeze(-1).to(torch.float16)


def _block_errors(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (block_quant.dequantize(codes, scales, "q4_0") - w).square().reshape(w.size(0), -1, 32).sum(-1)


def test_q8_0_and_q4_0_weights_are_llama_cpp_blocks():
    """34 and 18 bytes a block; Q8_0's codes decode within half a step of the weights; Q4_0's 4-bit codes with
    their float16 scales err no more than llama.cpp's reference rounding in any block (to the float16 rounding of
    the scale), and less over all: an all-zero block, a constant one and a block of one large value are exact."""
    torch.manual_seed(1)
    w = torch.randn(6, 128)
    codes, scales = quantize_q8_0(w)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (6, 4)
    step = scales.float().repeat_interleave(32, dim=1)
    assert ((block_quant.dequantize(codes, scales, "q8_0") - w).abs() <= 0.51 * step + 1e-3 * w.abs()).all()
    layer = BlockLinear(nn.Linear(128, 6), "q4_0", isa=None)
    assert layer.weight_bytes() == 6 * 4 * 18 and BlockLinear(nn.Linear(128, 6), "q8_0", isa=None).weight_bytes() == 6 * 4 * 34
    for weights in (torch.randn(64, 256), torch.randn(64, 256) ** 3, torch.rand(64, 256)):
        q4, s4 = quantize_q4_0(weights)
        assert q4.dtype == torch.uint8 and int(q4.max()) <= 15 and s4.dtype == torch.float16 and s4.shape == (64, 8)
        ours, reference = _block_errors(weights, q4, s4), _block_errors(weights, *_q4_0_reference(weights))
        assert (ours <= reference * (1 + 1e-4) + 1e-12).all()
        assert ours.sum() < 0.96 * reference.sum()
    exact = torch.zeros(3, 32)
    exact[1] = 0.5
    exact[2, 7] = -3.0
    q4, s4 = quantize_q4_0(exact)
    assert torch.equal(block_quant.dequantize(q4, s4, "q4_0"), exact)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_panels_hold_the_same_codes(fmt):
    torch.manual_seed(2)
    codes, scales = (quantize_q8_0 if fmt == "q8_0" else quantize_q4_0)(torch.randn(37, 96))
    back = unpack_panels(*pack_panels(codes, scales, fmt), 37, fmt)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)


def test_the_statement_is_the_product_of_the_quantized_values():
    """The reference adds float32 terms in order; it must be the dequantized activations times the dequantized
    weights to float32 rounding (a wrong scale or code anywhere breaks this, not only bitwise equality)."""
    x = _inputs(5, 320, seed=3)
    for fmt in ("q8_0", "q4_0"):
        layer = _layer(320, 21, fmt, isa=None)
        x_codes, x_scales = quantize_activations(x)
        x_values = (x_codes.double() * x_scales.double().unsqueeze(-1)).reshape(5, 320)
        expected = x_values @ layer.dequantized_weight().double().t() + layer.bias.double()
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)
        exact = x @ layer.dequantized_weight().t() + layer.bias  # and near x W^T (8-bit activations)
        assert (layer(x) - exact).norm() < 0.02 * exact.norm()


@needs_isa
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("isa", ISAS)
def test_each_path_equals_the_statement_bitwise(isa, fmt):
    for k, n in SHAPES:
        layer = _layer(k, n, fmt, isa=isa, bias=n % 2 == 1)
        codes, scales = layer.plain()
        for m in ROW_COUNTS:
            x = _inputs(m, k, seed=m)
            expected = reference_linear(x, codes, scales, layer.bias, fmt)
            got = layer(x)
            assert torch.equal(got, expected), (isa, fmt, k, n, m, (got - expected).abs().max())


@needs_isa
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("isa", ISAS)
def test_a_row_is_the_same_alone_and_in_any_batch(isa, fmt):
    layer = _layer(256, 40, fmt, isa=isa)
    x = _inputs(64, 256, seed=4)
    batch = layer(x)
    for i in (0, 1, 7, 8, 9, 63):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])
    assert torch.equal(layer(x[5:14]), batch[5:14])


@needs_isa
def test_sums_at_the_extremes_are_exact():
    """Activation codes of +-127 against weight codes of +-127 (Q8_0), 0 (Q4_0's -8) and 15 (Q4_0's largest)
    everywhere: AVX2's int16 sums must not saturate (2 x 127 x 127 a Q8_0 pair; a Q4_0 block's 4 x 2 x 2 x 15 x 127
    summed in int16 by tiles of 1 or 2 rows). Scales that are powers of two: the output is exact. 1, 2 and 3 rows:
    each tile height's path."""
    k = 256
    x = torch.full((3, k), 127 / 64)  # scale 1/64, codes 127
    x[1] = -x[1]
    sign = torch.where(torch.arange(17) % 2 == 0, 1.0, -1.0)
    largest = torch.full((k,), 7 / 8)
    largest[::32] = -1.0  # each block's largest magnitude: scale 1/8, -1 is code 0 and 7/8 code 15
    cases = (("q8_0", torch.full((k,), 127 / 128)), ("q4_0", torch.ones(k)), ("q4_0", largest))
    for isa in ISAS:
        for fmt, row in cases:
            linear = nn.Linear(k, 17, bias=False)
            with torch.no_grad():
                linear.weight.copy_(sign.unsqueeze(1) * row)
            layer = BlockLinear(linear, fmt, isa=isa)
            expected = (127 / 64) * row.sum() * sign
            for rows in (1, 2, 3):
                got = layer(x[:rows])
                assert torch.equal(got, torch.stack([expected, -expected, expected])[:rows]), (isa, fmt, rows)


def test_the_path_follows_pytorchs_capability(monkeypatch, caplog):
    """AVX-512 where PyTorch runs its own AVX-512 kernels and the CPU has VNNI, AVX2 where PyTorch is held to AVX2
    (`tserve.testing.avx2_only` sets ATEN_CPU_CAPABILITY=avx2), the PyTorch statement below that, said once."""
    cpu_kernels.kernel_isa.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_kernels.kernel_isa() == ("avx2" if "avx2" in ISAS else None)
    cpu_kernels.kernel_isa.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_kernels.kernel_isa() == ("avx512" if "avx512" in ISAS else "avx2" if "avx2" in ISAS else None)
    cpu_kernels.kernel_isa.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with caplog.at_level(logging.WARNING, logger="tserve.kernels"):
        layers = [BlockLinear(nn.Linear(64, 8), "q8_0") for _ in range(3)]
    assert all(layer.isa is None for layer in layers)
    assert sum("Q8_0 / Q4_0 kernels do not run here" in r.message for r in caplog.records) == 1
    x = _inputs(3, 64, seed=5)
    assert torch.equal(layers[0](x), reference_linear(x, layers[0].codes, layers[0].scales, layers[0].bias, "q8_0"))
    cpu_kernels.kernel_isa.cache_clear()


def test_a_failed_build_leaves_the_statement_serving(monkeypatch, tmp_path, caplog):
    """No compiler (the build raises): the kernels are None, one line says why, and a layer serves on the
    statement, with the numbers the kernels give where they run."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    def no_compiler(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("no C++ compiler")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING):
        built = cpu_kernels.extension.__wrapped__()  # the builder itself, past the process's cached build
    assert built is None and any("could not be built" in r.message for r in caplog.records)
    x = _inputs(4, 96, seed=6)
    native = [BlockLinear(nn.Linear(96, 19), fmt) for fmt in ("q8_0", "q4_0")]  # before: whatever runs here
    native_out = [layer(x) for layer in native]
    monkeypatch.setattr(cpu_kernels, "extension", lambda: built)
    cpu_kernels.kernel_isa.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tserve.kernels"):
            fallback = [BlockLinear(nn.Linear(96, 19), fmt) for fmt in ("q8_0", "q4_0")]
        assert any("kernels do not run here" in r.message for r in caplog.records)
        for layer, served, expected in zip(native, fallback, native_out, strict=True):
            assert served.isa is None
            served.codes, served.scales = layer.plain()
            served.bias = layer.bias
            assert torch.equal(served(x), expected)
    finally:
        cpu_kernels.kernel_isa.cache_clear()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_language_model_in_blocks_stays_close(fmt, tiny_lm):
    """Every linear layer, the output layer included, holds blocks (under q4_0 the output layer's are Q8_0, as
    llama.cpp's Q4_0 files keep theirs); the logits stay near float32's."""
    from tests.model.test_quantize import _logits  # noqa: PLC0415

    fp32, blocks = load(tiny_lm), load(tiny_lm, quantize=fmt)
    assert blocks.quantization == fmt
    assert not any(isinstance(m, nn.Linear) for m in blocks.model.modules())
    assert isinstance(blocks.model.lm_head, BlockLinear) and blocks.model.lm_head.fmt == "q8_0"
    layers = [m for m in blocks.model.modules() if isinstance(m, BlockLinear) and m is not blocks.model.lm_head]
    assert layers and all(m.fmt == fmt for m in layers)
    per_weight = {"q8_0": 34 / 32, "q4_0": 18 / 32}
    expected = sum(m.in_features * m.out_features * per_weight[m.fmt] for m in [*layers, blocks.model.lm_head])
    assert linear_weight_bytes(blocks.model) == pytest.approx(expected, rel=0.02)
    ref, got = _logits(fp32, "lm"), _logits(blocks, "lm")
    assert not torch.equal(ref, got)
    assert (got - ref).abs().max() < (0.05 if fmt == "q8_0" else 0.15) * (ref.max() - ref.min())
