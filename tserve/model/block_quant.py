"""Linear layers on llama.cpp's block-quantized weights, Q8_0 and Q4_0 (`--quantize q8_0` / `q4_0`): each run of
32 weights along a row has one float16 scale; Q8_0 holds int8 codes (weight = code x scale), Q4_0 4-bit codes
(weight = (code - 8) x scale), 34 and 18 bytes a block, as in GGUF files (a GGUF's blocks could be repacked into
these layers as they are, with no requantizing). The activations are quantized the same way inside the product:
each row's blocks of 32 get one float32 scale (amax / 127) and int8 codes; each block's dot product is an exact
int32 sum, and the output adds the blocks' float terms in order:

    out[m, n] = bias[n] + Σ_b float(isum[m, n, b]) * (w_scale[n, b] * x_scale[m, b])      (b = 0, 1, ... in turn)

`reference_linear` states that as PyTorch calls; our C++ kernels (`tserve/model/kernels/block_quant.cpp`: AVX-512
VNNI and AVX2, chosen at run time) equal it bit for bit, for any number of rows (a row's result is its own: the
same alone and in any batch). Where they are not built, or PyTorch's own kernels are held below AVX2, the
reference serves (with one log line saying so): the same numbers, several times slower. CPU, float32 models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tserve.model.kernels import cpu as cpu_kernels

BLOCK = 32  # weights per scale, llama.cpp's QK8_0 and QK4_0
FORMATS = ("q8_0", "q4_0")
_FORMAT_CODE = {"q8_0": 0, "q4_0": 1}  # what the kernel's `format` argument calls them
_COLS = 16  # output columns per packed panel (the kernel's kCols)
_Q8_LEVELS = 127.0


def quantize_q8_0(weight: Tensor) -> tuple[Tensor, Tensor]:
    """llama.cpp's Q8_0 of a float32 (N, K) weight, K a multiple of 32: codes (N, K) int8 and scales (N, K / 32)
    float16. d = amax / 127, stored as float16; codes round(w / d) against the float32 d, as llama.cpp does
    (half to even where llama.cpp's reference rounds half away from zero: ties only)."""
    blocks = weight.float().reshape(weight.size(0), -1, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True).div(_Q8_LEVELS)
    inverse = torch.where(d != 0, torch.ones_like(d).div(d), torch.zeros_like(d))
    codes = blocks.mul(inverse).round_().clamp_(-127, 127).to(torch.int8)
    return codes.reshape(weight.shape), d.squeeze(-1).to(torch.float16)


def quantize_q4_0(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_0 blocks of a float32 (N, K) weight, K a multiple of 32: codes (N, K) uint8 0..15 and scales (N, K / 32)
    float16; the weight is (code - 8) x scale, llama.cpp's format. llama.cpp's reference (quantize_row_q4_0_ref)
    maps each block's value of largest magnitude (sign kept) to -8; here the scale is the one of least squared
    error among a few such mappings (the extreme to -8 - 0.1 k, k in `_Q4_CANDIDATES`, each with the least-squares
    scale of its codes), as llama.cpp's k-quants choose theirs (`make_qx_quants`): no block's error is larger
    than the reference's (to float16 rounding of the scale), and 6-15% less squared error over all (Gaussian
    weights 11%, uniform 15%, cubed Gaussian 6%; the bundled LM's 10%).
    The bundled LM's next-token agreement with float32 over its test split: 83.31% -> 83.89% with every layer
    Q4_0, 86.85% -> 87.54% with the output layer Q8_0 as `--quantize q4_0` has it (docs/benchmarks/roofline.md).
    Rows are done `_Q4_ROWS` at a time, so that the candidates' passes stay in cache: ~1 s for 135M weights on 2
    cores."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // BLOCK, dtype=torch.float16)
    for r in range(0, n, _Q4_ROWS):
        blocks = weight[r : r + _Q4_ROWS].float().reshape(-1, k // BLOCK, BLOCK)
        d = _least_squares_q4_scale(blocks).to(torch.float16)
        inverse = torch.where(d != 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        codes[r : r + _Q4_ROWS] = blocks.mul(inverse).round_().clamp_(-8, 7).add_(8).to(torch.uint8).reshape(-1, k)
        scales[r : r + _Q4_ROWS] = d.squeeze(-1)
    return codes, scales


# llama.cpp's mapping first, so that it keeps the blocks it fits exactly (a tie is never taken from it); 19 candidates
# (llama.cpp's -9..9) chose no better on the bundled LM.
_Q4_CANDIDATES = (0, -6, -3, 3, 6)
_Q4_ROWS = 1024


def _least_squares_q4_scale(blocks: Tensor) -> Tensor:
    """(..., 32) float32 blocks -> each block's scale (..., 1): of the codes round(w x -(8 + 0.1 k) / extreme),
    clamped to -8..7, for each candidate k, the least-squares scale sum(w c) / sum(c c) of the codes that fit best
    (the largest sum(w c)^2 / sum(c c): the least squared error)."""
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # the first of equal magnitudes
    safe = torch.where(extreme != 0, extreme, torch.ones_like(extreme))
    best_fit, best = torch.full_like(extreme, -1.0), torch.zeros_like(extreme)  # every fit >= 0: the first is taken
    for k in _Q4_CANDIDATES:
        c = blocks.mul(-(8.0 + 0.1 * k) / safe).round_().clamp_(-8, 7)
        wc = blocks.mul(c).sum(-1, keepdim=True)
        cc = c.mul_(c).sum(-1, keepdim=True).clamp_min_(1.0)  # an all-zero block: codes 0, scale 0
        fit = wc * wc / cc
        better = fit > best_fit
        best_fit, best = torch.where(better, fit, best_fit), torch.where(better, wc / cc, best)
    return best


def dequantize(codes: Tensor, scales: Tensor, fmt: str) -> Tensor:
    """The float32 (N, K) weight that codes and scales encode."""
    values = codes.float() - (8.0 if fmt == "q4_0" else 0.0)
    return (values.reshape(codes.size(0), -1, BLOCK) * scales.float().unsqueeze(-1)).reshape(codes.shape)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows (M, K) float32 -> codes (M, K / 32, 32) int8 and scales (M, K / 32) float32: d = amax / 127, code =
    round-half-even(x * (127 / amax)) (llama.cpp's AVX rounding), 0 for a block of zeros."""
    blocks = x.reshape(x.size(0), -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    inverse = torch.where(amax != 0, torch.full_like(amax, _Q8_LEVELS).div(amax), torch.zeros_like(amax))
    codes = blocks.mul(inverse.unsqueeze(-1)).round_().to(torch.int8)
    return codes, amax.div(_Q8_LEVELS)


def reference_linear(x: Tensor, codes: Tensor, scales: Tensor, bias: Tensor | None, fmt: str) -> Tensor:
    """The kernel's maths as PyTorch calls: x (M, K) float32 against codes (N, K) and scales (N, K / 32) of
    `fmt` -> (M, N) float32. The integer sums are exact (float64 holds every one), each block's term is rounded to
    float32 as the kernel rounds it, and the terms are added block after block."""
    x_codes, x_scales = quantize_activations(x)
    w = codes.to(torch.float64) - (8.0 if fmt == "q4_0" else 0.0)
    sums = torch.einsum("mbk,nbk->mnb", x_codes.double(), w.reshape(w.size(0), -1, BLOCK)).float()
    block_scales = scales.float().unsqueeze(0) * x_scales.unsqueeze(1)  # (M, N, blocks)
    terms = sums.mul_(block_scales)
    out = torch.zeros(x.size(0), codes.size(0))
    for b in range(terms.size(-1)):
        out.add_(terms[..., b])
    return out if bias is None else out.add_(bias)


def pack_panels(codes: Tensor, scales: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """Codes (N, K) and scales (N, K / 32) -> the kernel's panels (ceil(N / 16), K / 32, bytes) uint8 and scales
    (ceil(N / 16), K / 32, 16) float16. Per panel and block, the 16 columns' codes four inputs at a time
    ((quad, column, 4) bytes): Q8_0's plus 128 (unsigned), Q4_0's as llama.cpp's nibbles, input i of the block in
    the low half of a byte and input 16 + i in the high half ((quad 0..3, column, 4))."""
    n, k = codes.shape
    n_pad = -n % _COLS
    panels, blocks = (n + n_pad) // _COLS, k // BLOCK
    if fmt == "q8_0":
        unsigned = (F.pad(codes, (0, 0, 0, n_pad)).to(torch.int16) + 128).to(torch.uint8)
        laid = unsigned.reshape(panels, _COLS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    else:
        q = F.pad(codes, (0, 0, 0, n_pad), value=8).reshape(panels, _COLS, blocks, 2, 4, 4)
        laid = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
    scale_panels = F.pad(scales, (0, 0, 0, n_pad)).reshape(panels, _COLS, blocks).transpose(1, 2)
    return laid.reshape(panels, blocks, -1).contiguous(), scale_panels.contiguous()


def unpack_panels(panels: Tensor, scale_panels: Tensor, n: int, fmt: str) -> tuple[Tensor, Tensor]:
    """`pack_panels` undone: codes (n, K) and scales (n, K / 32)."""
    count, blocks = panels.size(0), panels.size(1)
    if fmt == "q8_0":
        laid = panels.reshape(count, blocks, 8, _COLS, 4).permute(0, 3, 1, 2, 4)
        codes = (laid.to(torch.int16) - 128).to(torch.int8)
    else:
        laid = panels.reshape(count, blocks, 4, _COLS, 4).permute(0, 3, 1, 2, 4)
        codes = torch.stack([laid & 0x0F, laid >> 4], dim=3)
    scales = scale_panels.transpose(1, 2).reshape(count * _COLS, blocks)
    return codes.reshape(count * _COLS, blocks * BLOCK)[:n], scales[:n]


def _block_bytes(rows: int, in_features: int, fmt: str) -> int:
    """Bytes of `rows` rows of `fmt` blocks over `in_features` inputs (padded to whole blocks): a float16 scale
    and 32 codes a block, Q8_0's a byte each, Q4_0's two a byte."""
    blocks = rows * -(-in_features // BLOCK)
    return blocks * (2 + (BLOCK if fmt == "q8_0" else BLOCK // 2))


class BlockLinear(nn.Module):
    """`nn.Linear`'s forward on Q8_0 or Q4_0 weights (`fmt`), on our kernels' panels where they run (`isa`: the
    path, default `cpu_kernels.kernel_isa()`; None: the PyTorch reference, on the plain codes). Input features that are not a
    multiple of 32 are padded with zero weights (and the input with zeros). `blocks`: the layer's codes and scales
    already made (a GGUF file's own, `model.gguf.blocks`), held as they are instead of quantizing its weight."""

    def __init__(self, linear: nn.Linear, fmt: str, isa: str | None = "auto",
                 blocks: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"block format must be one of {FORMATS}, got {fmt!r}")
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.isa = cpu_kernels.kernel_isa() if isa == "auto" else isa
        self._k_pad = -self.in_features % BLOCK
        if blocks is None:
            weight = F.pad(linear.weight.detach().float(), (0, self._k_pad))
            codes, scales = (quantize_q8_0 if fmt == "q8_0" else quantize_q4_0)(weight)
        else:
            codes, scales = blocks
            width = self.in_features + self._k_pad
            if codes.shape != (self.out_features, width) or scales.shape != (self.out_features, width // BLOCK):
                raise ValueError(f"blocks of shapes {tuple(codes.shape)} and {tuple(scales.shape)} do not fit a "
                                 f"({self.out_features}, {self.in_features}) layer")
        if self.isa is not None:
            codes, scales = pack_panels(codes, scales, fmt)
        self.register_buffer("codes", codes, persistent=False)  # plain, or the kernel's panels
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self._k_pad:
            rows = F.pad(rows, (0, self._k_pad))
        if self.isa is None:
            out = reference_linear(rows, self.codes, self.scales, self.bias, self.fmt)
        else:
            out = cpu_kernels.extension().block_linear(rows.contiguous(), self.codes, self.scales, self.bias,
                                                       self.out_features, _FORMAT_CODE[self.fmt], self.isa)
        return out.reshape(*x.shape[:-1], self.out_features)

    def plain(self) -> tuple[Tensor, Tensor]:
        """Codes (out, padded in) and scales (out, blocks), whichever layout holds them."""
        if self.isa is None:
            return self.codes, self.scales
        return unpack_panels(self.codes, self.scales, self.out_features, self.fmt)

    def dequantized_weight(self) -> Tensor:
        """The float32 (out, in) weight the codes and scales encode."""
        return dequantize(*self.plain(), self.fmt)[:, : self.in_features]

    def weight_bytes(self) -> int:
        """Bytes a GGUF file gives these blocks: 34 (Q8_0) or 18 (Q4_0) per 32 weights."""
        return _block_bytes(self.out_features, self.in_features, self.fmt)

    @staticmethod
    def held_bytes_of(out_features: int, in_features: int, fmt: str, isa: str | None = "auto") -> int:
        """What a layer of that shape holds besides its bias: its blocks, in our kernels' panels of 16 output
        columns (`isa`, default `cpu_kernels.kernel_isa()`), or one byte a code where the reference serves."""
        if (cpu_kernels.kernel_isa() if isa == "auto" else isa) is None:
            return _block_bytes(out_features, in_features, "q8_0")
        return _block_bytes(out_features + -out_features % _COLS, in_features, fmt)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.fmt}, kernel={self.isa or 'pytorch'}")
