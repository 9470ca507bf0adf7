"""int8 weights for the linear layers of any of the three model kinds, on PyTorch's own dynamic-quantization
GEMM (fbgemm / oneDNN): each `nn.Linear` becomes an `Int8Linear` that holds its weight as int8 with one scale
per output channel. Embeddings, norms and the KV cache stay in float32. CPU only: PyTorch has no CUDA kernel
for these ops (on a GPU, bfloat16 is the smaller type to use).

Activations are quantized per row (per token), not per batch. `quantized::linear_dynamic` picks one scale for
its whole input; fed each row mapped onto [0, 1] (`(x - min) / (max - min)`), every input it sees spans
exactly [0, 1], so that one scale is always 1/255 (1/127 with 7-bit activations) and each row gets all the
levels over its own range. The affine map is undone on the output: `W x = span * (W x01) + min * rowsum(W)`.
Two things follow:
- a row's result no longer depends on the other rows of the batch: a request's int8 output is the same alone
  and beside others (with one scale per batch, one long-tailed row coarsened every row's steps);
- accuracy: on the bundled translator's 200-sentence test slice, 92.5% of the 4-beam translations equal
  float32's, against 78% with PyTorch's default (one 7-bit scale per batch; docs/BENCHMARKS.md).

How many bits a row gets depends on the GEMM's kernel (`ACTIVATIONS`):
- `full`: one GEMM with 8-bit activations. PyTorch's kernel takes them where it sums in int32 (VNNI, AMX).
  Without VNNI, fbgemm multiplies u8 by s8 in pairs summed into a saturating int16 (`vpmaddubsw`):
  255 x 127 x 2 overflows it, which is why PyTorch's own dynamic Linear passes `reduce_range=True` (7-bit
  activations). There `full` runs on our exact AVX2 kernel instead (`tserve/model/kernels/int8_gemm.cpp`: weights
  widened to int16 in registers, pairs summed in int32 by `vpmaddwd`), at about one 7-bit GEMM's speed;
  refused only where that kernel is not built.
- `split`: each row's 14-bit code `c = 128 hi + lo` as two 7-bit halves, both rows of one GEMM
  (`W c = 128 W hi + W lo`). 7-bit inputs never saturate, so this is exact on every kernel, and gives more
  levels than `full`; it costs a GEMM of twice the rows (2-3x `7bit`'s time on an AVX2 kernel).
- `7bit`: one GEMM with 7-bit activations: any kernel, fastest there, least accurate.
- `7bit-weights`: one GEMM with 8-bit activations and weights of 7 bits (-63..63, one scale per output
  channel): 255 x 63 x 2 fits the int16 sum, so it is exact on every kernel, at `7bit`'s speed; the rounding
  error moves from the activations to the weights.
- `auto`: `full` (on PyTorch's kernel where a probe GEMM shows that it does not saturate, else on ours),
  `split` where neither can take 8 bits. The probe asks the kernel itself, so it follows whatever fbgemm
  chose (`FBGEMM_ENABLE_INSTRUCTIONS=AVX2` forces the AVX2 kernels on any CPU).
On the bundled translator's 200-sentence slice, the 4-beam translations equal to float32's: `full` 92.5%,
`split` 95%, `7bit` 87.5% (docs/BENCHMARKS.md).

The output (vocabulary) layer's `full` GEMM is oneDNN's where that sums 8-bit activations in int32 (VNNI, AMX):
the largest product of a step (NLLB's 1024 x 256k for every beam), where it is 1.4-2x fbgemm's from 16 rows up
(`output_layer_engine`). Each layer keeps one engine for every batch, so a row's result stays its own.

int4 weights (`Int4Linear`) are group-wise: each run of `group_size` (32, 64 or 128) weights along a row has its
own scale and minimum (asymmetric: 16 levels between the group's extremes), an eighth of float32's bytes plus
4 bytes per group. The GEMM is PyTorch's CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`), vectorised for
bfloat16 activations on AVX2 and AVX-512 alike (with float32 or float16 ones it falls back to a scalar loop tens
of times slower), so each layer takes its input in bfloat16 and gives float32 back. Rows are computed
independently: a row's result is the same alone and in any batch (tested).

Under int4 the output (vocabulary) layer of the language model and the translator is int8 (`Int8Linear`), every
other linear layer int4: its rounding errors land on the logits that choose the next token, with no later layer
to smooth them (llama.cpp keeps it at Q6_K in its 4-bit files, AWQ and GPTQ in 16 bits). On the bundled language
model's test split the next token agrees with float32's on 88.94% of positions, against 85.68% with an int4
output layer (docs/benchmarks/roofline.md). `q4_0` keeps its output layer in Q8_0 for the same reason, as
llama.cpp's `llama-quantize` does unless `--pure` (`output.weight`, or `token_embd.weight` where the two are tied:
Q6_K, Q8_0 where the width is not a multiple of 256, which Q6_K's 256-weight blocks need; we have no Q6_K): 86.85%
agreement against 83.31% with a Q4_0 one, 87.54% with Q4_0's least-squares scales (`block_quant.quantize_q4_0`). A
GGUF file's own blocks of that layer, of either format, are kept as they are."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from tserve.model.block_quant import FORMATS as BLOCK_FORMATS
from tserve.model.block_quant import BlockLinear
from tserve.model.kernels import cpu as cpu_kernels

QUANTIZATIONS = ("none", "int8", "int4", *BLOCK_FORMATS)  # q8_0 / q4_0: llama.cpp's blocks (model.block_quant)
INT4_GROUP_SIZES = (32, 64, 128)
OUTPUT_LAYER = "lm_head"  # the language model's and the translator's vocabulary projection: int8 under int4
Q4_0_OUTPUT = "q8_0"  # the output layer's blocks under q4_0, as llama.cpp's Q4_0 files keep theirs (module docstring)
OUTPUT_FORMATS = {"int4": "int8", "q4_0": Q4_0_OUTPUT}  # the output layer's format where it is not the others'
_INT4_N_MULTIPLE = 16  # the packed layout takes output features in tiles of 16
_INT8_PANEL_COLUMNS = 16  # the exact int8 kernel's panels (`int8_gemm.cpp`'s kCols)


ACTIVATIONS = ("auto", "full", "split", "7bit", "7bit-weights")
_WEIGHT_LEVELS = {"7bit-weights": 63}  # the largest weight code (else 127)
_SPLIT = 128  # a 14-bit code is 128 x its high half (0..127) + its low half (0..127)
_SPLIT_LEVELS = (_SPLIT - 1) * _SPLIT  # the largest code: a row's maximum
_LEVELS = 255  # the largest 8-bit code


@functools.cache
def full_range_activations(engine: str | None = None) -> bool:
    """Whether this process's int8 GEMM (PyTorch's default engine, or `engine`) takes 8-bit activations without
    overflow: one dot product whose u8 x s8 pairs sum past int16 (2 x 255 x 127), compared with its exact value."""
    k, n = 256, 8
    weight = _quantize_weight(torch.ones(n, k), torch.full((n,), 1 / 127, dtype=torch.double))
    with _quantized_engine(engine):
        packed = torch.ops.quantized.linear_prepack(weight, None)
    # Row 0 quantizes to 255 everywhere (scale 1/255, zero point 0); row 1 sets the minimum.
    got = torch.ops.quantized.linear_dynamic(torch.tensor([[1.0] * k, [0.0] * k]), packed, reduce_range=False)
    return abs(float(got[0, 0]) - k) < 0.5


def full_activations_kernel() -> str | None:
    """The kernel that takes `full` (8-bit) activations in this process: "pytorch" where its GEMM sums in int32,
    else "exact" (ours) where it is built; None where neither can."""
    if full_range_activations():
        return "pytorch"
    return "exact" if cpu_kernels.available() else None


def resolve_activations(activations: str) -> str:
    """`auto` made `full` or `split` for this process's kernels; `full` refused where it would overflow."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"int8 activations must be one of {ACTIVATIONS}, got {activations!r}")
    full = full_activations_kernel() is not None
    if activations == "auto":
        return "full" if full else "split"
    if activations == "full" and not full:
        raise ValueError("8-bit int8 activations overflow this CPU's int8 kernel (it sums pairs in int16: no "
                         "VNNI or AMX) and our exact kernel is not built; use 'auto' or 'split'")
    return activations


@contextlib.contextmanager
def _quantized_engine(engine: str | None) -> Iterator[None]:
    """Weights packed inside are packed for `engine` (None: the default); a packed weight keeps its engine, so
    later calls need no switch."""
    if engine is None:
        yield
        return
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def output_layer_engine(activations: str) -> str | None:
    """The int8 engine of the output (vocabulary) layer: oneDNN where its GEMM sums 8-bit activations in int32
    (VNNI, AMX), else None (the default engine, as every other layer). Its products are the largest of a step
    (NLLB's: 1024 x 256k, for every beam), and there oneDNN is 1.4-2x fbgemm from 16 rows up and level below
    (docs/benchmarks/nllb.md). One engine per layer for every batch: a row's result stays the same alone
    and in any batch."""
    if activations != "full" or "onednn" not in torch.backends.quantized.supported_engines:
        return None
    return "onednn" if full_range_activations("onednn") else None


def _quantize_weight(weight: Tensor, scales: Tensor) -> Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao, not removed
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)


class Int8Linear(nn.Module):
    """`nn.Linear`'s forward with an int8 weight (one scale per output channel) and int8 activations (one
    scale per row; `activations`: `full`, `split`, `7bit` or `7bit-weights`, see the module's docstring)."""

    def __init__(self, linear: nn.Linear, activations: str, exact: bool | None = None,
                 engine: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        levels = _WEIGHT_LEVELS.get(activations, 127)
        scales = (weight.abs().amax(dim=1) / levels).clamp_min(1e-12).double()
        qweight = _quantize_weight(weight, scales)
        # `full` where PyTorch's kernel would overflow: our exact kernel, on its own layout of the int8 weights
        # (`exact` forces the choice, for tests on any CPU).
        if activations == "full" and exact is None:
            resolve_activations("full")  # refused where no kernel takes 8 bits
            exact = self.runs_exact(activations)
        self.exact = activations == "full" and bool(exact)
        if self.exact:
            kernels = cpu_kernels.extension()
            if kernels is None:
                raise RuntimeError("the CPU kernels are not built")
            self.register_buffer("panels", kernels.int8_pack_panels(qweight.int_repr()), persistent=False)
            self.register_buffer("coefficients", (scales / _LEVELS).float(), persistent=False)
        else:
            # Packed for the default engine (fbgemm on x86). oneDNN's GEMM uses AMX where the CPU has it and is
            # 2x faster from about 32 rows, but 1.2-1.8x slower below 16 (one request's decode steps); one engine
            # for every row count, since the two round their outputs differently and a row must get the same
            # numbers in any batch.
            with _quantized_engine(engine):
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        # The packed weight is an opaque object, neither parameter nor buffer: its bytes, for what a model holds.
        self.packed_bytes = 0 if self.exact else qweight.numel() * qweight.element_size()
        self.engine = None if self.exact else engine  # `engine`: PyTorch's int8 engine for this layer (None: default)
        # Σ_k W[n, k] of the int8 weight as the GEMM sees it: the term that restores each row's minimum.
        self.register_buffer("weight_row_sums", qweight.dequantize().sum(dim=1).unsqueeze(0), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)
        self.activations = activations

    @staticmethod
    def runs_exact(activations: str) -> bool:
        """Whether a layer of `activations` (resolved) runs on our exact kernel: `full` where PyTorch's overflows."""
        return activations == "full" and full_activations_kernel() == "exact"

    @classmethod
    def held_bytes_of(cls, out_features: int, in_features: int, activations: str) -> int:
        """What a layer of that shape and `activations` (resolved) holds besides its bias, as `held_bytes` counts it:
        the int8 weights (in the exact kernel's panels of 16 columns and pairs of inputs, or PyTorch's packed
        object), their row sums and the exact kernel's coefficients."""
        if cls.runs_exact(activations):
            panels = -(-out_features // _INT8_PANEL_COLUMNS) * _INT8_PANEL_COLUMNS * (in_features + in_features % 2)
            return panels + 2 * 4 * out_features
        return out_features * in_features + 4 * out_features

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        kernels = cpu_kernels.extension() if rows.dtype == torch.float32 else None
        if kernels is None:  # not built, or rows that are not float32: the same values as PyTorch calls
            return self._forward_in_steps(rows).reshape(*x.shape[:-1], self.out_features)
        if self.exact:
            out = kernels.int8_linear_exact(rows.contiguous(), self.panels, self.coefficients, self.weight_row_sums,
                                            self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        # Our kernels' two passes (`tserve/model/kernels/int8_rows.cpp`): the same values as `_forward_in_steps`.
        split = self.activations == "split"
        gemm_in, low, span = kernels.int8_rows_in(rows.contiguous(), split)
        product = torch.ops.quantized.linear_dynamic(gemm_in, self._packed, reduce_range=self._reduce_range)
        out = kernels.int8_rows_out(product, low, span, self.weight_row_sums, self.bias, split)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def _reduce_range(self) -> bool:
        """7-bit activations for the GEMM: `7bit`, and `split`'s halves (each 7 bits)."""
        return self.activations in ("7bit", "split")

    def _forward_in_steps(self, rows: Tensor) -> Tensor:
        """The forward as PyTorch calls (where our kernels are not built): rows (N, in) -> (N, out)."""
        # amin + amax: two passes, yet several times faster than `torch.aminmax` over the last dimension.
        low, high = rows.amin(dim=-1, keepdim=True), rows.amax(dim=-1, keepdim=True)
        span = (high - low).clamp_(min=1e-12)
        if self.exact:
            product = self._exact_product(rows, low, span)
        elif self.activations == "split":
            product, span = self._split_product(rows, low, span), span / _SPLIT_LEVELS
        else:
            # (x - min) / span puts each row's own extremes exactly at 0 and 1 (a constant row is all 0), so
            # the GEMM's one scale is 1/255 (1/127 with 7-bit activations).
            product = torch.ops.quantized.linear_dynamic((rows - low).div_(span), self._packed,
                                                         reduce_range=self._reduce_range)
        out = low * self.weight_row_sums if self.bias is None else torch.addcmul(self.bias, low, self.weight_row_sums)
        return out.addcmul_(product, span)

    def _split_product(self, rows: Tensor, low: Tensor, span: Tensor) -> Tensor:
        """W c for each row's 14-bit code c = round((x - min) / span * _SPLIT_LEVELS) = 128 hi + lo, as
        128 W hi + W lo from one GEMM over the rows [lo; hi]. Each non-constant row's maximum has hi = 127 and
        every minimum is 0, so the GEMM's one 7-bit scale is exactly 1 and the integer halves are its int8
        inputs as they are. Five passes over the rows, written straight into the GEMM's input."""
        n = rows.shape[0]
        halves = rows.new_empty(2 * n, self.in_features)
        low_half, high_half = halves[:n], halves[n:]
        # x - min first: exactly 0 at each row's minimum (and everywhere in a constant row, whose step is huge).
        torch.sub(rows, low, out=low_half).mul_(_SPLIT_LEVELS / span).round_()  # the code, for now
        torch.div(low_half, _SPLIT, rounding_mode="floor", out=high_half)
        low_half.sub_(high_half, alpha=_SPLIT)
        products = torch.ops.quantized.linear_dynamic(halves, self._packed, reduce_range=True)
        return torch.add(products[:n], products[n:], alpha=_SPLIT)  # 128 x is exact: one rounding, as before

    def _exact_product(self, rows: Tensor, low: Tensor, span: Tensor) -> Tensor:
        """What our exact kernel computes, as PyTorch calls (its reference): each row's 8-bit codes, their exact
        integer products with the int8 weights (float64 holds every int32 sum exactly), rounded to float32 once
        and scaled per output column."""
        codes = (rows - low).div_(span).mul_(_LEVELS).round_().clamp_(0, _LEVELS)
        return (codes.double() @ self.int8_weight().double().T).float().mul_(self.coefficients)

    def int8_weight(self) -> Tensor:
        """The (out, in) int8 weight, from whichever kernel's layout holds it."""
        if not self.exact:
            return torch.ops.quantized.linear_unpack(self._packed)[0].int_repr()
        panels, pairs = self.panels.size(0), self.panels.size(1)  # (panels, pairs, 16 columns, 2)
        weight = self.panels.permute(0, 2, 1, 3).reshape(panels * self.panels.size(2), 2 * pairs)
        return weight[: self.out_features, : self.in_features]

    def extra_repr(self) -> str:
        gemm = ", gemm=exact" if self.exact else f", engine={self.engine}" if self.engine else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activations={self.activations}{gemm}")


class Int4Linear(nn.Module):
    """`nn.Linear`'s forward with group-wise int4 weights (see the module's docstring): bfloat16 activations
    into PyTorch's CPU int4 GEMM, float32 out. Layers whose sizes the packed layout does not take are padded
    with zero weights: output features to a multiple of 16 (the extra outputs dropped), input features to a
    multiple of the group size (the input padded with zeros)."""

    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        super().__init__()
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        weight = linear.weight.detach().float()
        self._k_pad = -self.in_features % group_size
        n_pad = -self.out_features % _INT4_N_MULTIPLE
        weight = torch.nn.functional.pad(weight, (0, self._k_pad, 0, n_pad))
        codes, scales, zeros = _int4_groups(weight, group_size)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2),
                             persistent=False)
        # [groups, out, 2]: the kernel computes each weight as (code - 8) * scale + zero.
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1)
                             .contiguous().to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)

    def dequantized_weight(self) -> Tensor:
        """The float32 weight the kernel multiplies by (what the codes, scales and zeros encode)."""
        eye = torch.eye(self.in_features + self._k_pad, dtype=torch.bfloat16)
        columns = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_and_zeros)
        return columns.t()[: self.out_features, : self.in_features].float()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self._k_pad:
            rows = torch.nn.functional.pad(rows, (0, self._k_pad))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, self.group_size,
                                                         self.scales_and_zeros)
        out = out[:, : self.out_features].float()
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        return self.held_bytes_of(self.out_features, self.in_features, self.group_size)

    @staticmethod
    def held_bytes_of(out_features: int, in_features: int, group_size: int) -> int:
        """What a layer of that shape holds besides its bias: two int4 codes a byte, and a bfloat16 scale and zero
        per group, over the padded sizes."""
        n = out_features + -out_features % _INT4_N_MULTIPLE
        k = in_features + -in_features % group_size
        return n * k // 2 + n * (k // group_size) * 2 * 2

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}")


def _int4_groups(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes 0..15 (int32, [out, in]), and each group's scale and zero ([out, groups]) such that
    (code - 8) * scale + zero approximates the weight. Start from 16 levels between the group's extremes, then
    twice fit scale and offset to the codes by least squares and re-round (on the bundled translator: 6% less
    weight error than the extremes alone, 4-beam translations equal to float32's 57% -> 66%)."""
    out, k = weight.shape
    groups = weight.reshape(out, k // group_size, group_size)
    offset = groups.amin(dim=-1)
    scale = ((groups.amax(dim=-1) - offset) / 15).clamp_min(1e-12)
    codes = _int4_codes(groups, scale, offset)
    for _ in range(2):
        mean_code, mean_weight = codes.mean(dim=-1), groups.mean(dim=-1)
        centred = codes - mean_code.unsqueeze(-1)
        fitted = (centred * (groups - mean_weight.unsqueeze(-1))).sum(-1) / centred.square().sum(-1).clamp_min(1e-12)
        scale = torch.where(fitted > 0, fitted, scale)  # a constant group keeps its (tiny) scale
        offset = mean_weight - scale * mean_code
        codes = _int4_codes(groups, scale, offset)
    # Scales and zeros are stored in bfloat16: the codes are chosen last against the rounded values, so that the
    # rounding of the scale does not shift every weight of the group.
    scale = scale.to(torch.bfloat16).float()
    zero = (offset + 8 * scale).to(torch.bfloat16).float()
    codes = _int4_codes(groups, scale, zero - 8 * scale)
    return codes.reshape(out, k).to(torch.int32), scale, zero


def _int4_codes(groups: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """The nearest of the 16 levels offset + scale * code to each weight."""
    return torch.round((groups - offset.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)


def _check_cpu_float32(model: nn.Module, what: str) -> None:
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        raise ValueError(f"{what} weights need a float32 model on the CPU (got {first.dtype} on {first.device}): "
                         f"PyTorch's {what} kernels used here are CPU kernels")


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, make(child))
    return model


def quantize_int8(model: nn.Module, activations: str = "auto") -> nn.Module:
    """Replace every `nn.Linear` of a float32 CPU `model` in place; returns it. Inference only.
    `activations`: one of `ACTIVATIONS`."""
    activations = resolve_activations(activations)
    _check_cpu_float32(model, "int8")
    vocabulary = getattr(model, OUTPUT_LAYER, None)
    if type(vocabulary) is nn.Linear:  # on its own engine (`output_layer_engine`); a tied one gets its own copy
        setattr(model, OUTPUT_LAYER, Int8Linear(vocabulary, activations, engine=output_layer_engine(activations)))
    return _replace_linears(model, lambda linear: Int8Linear(linear, activations))


def quantize_int4(model: nn.Module, group_size: int = 32) -> nn.Module:
    """Replace every `nn.Linear` of a float32 CPU `model` in place with an `Int4Linear`, except the output
    (vocabulary) layer `OUTPUT_LAYER`, which becomes an `Int8Linear` (activations `auto`); returns it."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    _check_cpu_float32(model, "int4")
    output = getattr(model, OUTPUT_LAYER, None)
    if type(output) is nn.Linear:  # a tied one gets its own int8 copy; the embedding stays float32
        activations = resolve_activations("auto")
        setattr(model, OUTPUT_LAYER, Int8Linear(output, activations, engine=output_layer_engine(activations)))
    return _replace_linears(model, lambda linear: Int4Linear(linear, group_size))


# A layer's own codes, scales and format where they are already made (a GGUF file's blocks), else None.
# (a linear layer, the format it is to take) -> its stored blocks (codes, scales, their format), or None
GivenBlocks = Callable[[nn.Linear, str], "tuple[Tensor, Tensor, str] | None"]


def quantize_blocks(model: nn.Module, fmt: str, given: GivenBlocks | None = None) -> nn.Module:
    """Replace every `nn.Linear` of a float32 CPU `model` with a `BlockLinear` of `fmt` (`q8_0` or `q4_0`) in
    place, except under `q4_0` the output (vocabulary) layer `OUTPUT_LAYER`, which becomes Q8_0 (`Q4_0_OUTPUT`);
    returns it. `given`: a layer's blocks as they are where it has them (which format it keeps is the giver's
    rule: told the layer's format), quantized from its weight where it answers None."""
    _check_cpu_float32(model, fmt)

    def block_linear(linear: nn.Linear, fmt: str = fmt) -> BlockLinear:
        blocks = given(linear, fmt) if given is not None else None
        if blocks is None:
            return BlockLinear(linear, fmt)
        return BlockLinear(linear, blocks[2], blocks=blocks[:2])

    head = getattr(model, OUTPUT_LAYER, None)
    if fmt == "q4_0" and type(head) is nn.Linear:  # a tied one gets its own copy; the embedding stays float32
        setattr(model, OUTPUT_LAYER, block_linear(head, Q4_0_OUTPUT))
    return _replace_linears(model, block_linear)


def is_int8_linear(module: nn.Module) -> bool:
    return isinstance(module, Int8Linear)


def is_quantized_linear(module: nn.Module) -> bool:
    return isinstance(module, (Int8Linear, Int4Linear, BlockLinear))


def quantized_layer_bytes(fmt: str, out_features: int, in_features: int, activations: str = "auto",
                          group_size: int = 32) -> int:
    """What one linear layer of that shape holds once quantized as `fmt` (int8, int4, q8_0, q4_0), besides its
    bias (float32 as before): each format's own rule."""
    if fmt == "int8":
        return Int8Linear.held_bytes_of(out_features, in_features, resolve_activations(activations))
    if fmt == "int4":
        return Int4Linear.held_bytes_of(out_features, in_features, group_size)
    return BlockLinear.held_bytes_of(out_features, in_features, fmt)


def quantized_bytes_change(model: nn.Module, fmt: str, activations: str = "auto", group_size: int = 32) -> int:
    """What quantizing the float `model` as `fmt` (`model.checkpoint.load`'s `quantize`) changes in what it holds,
    from its layers' shapes alone (a model built on the meta device will do, its gated MLPs fused as served):
    each linear layer's float weight freed (a tied output layer's stays, the embedding's), its format's bytes
    held (the output layer's own under int4 and q4_0, `OUTPUT_FORMATS`). Negative: bytes saved."""
    output_layer = getattr(model, OUTPUT_LAYER, None)
    kept = {id(p) for m in model.modules() if type(m) is not nn.Linear for p in m.parameters(recurse=False)}
    change = 0
    for m in model.modules():
        if type(m) is not nn.Linear:
            continue
        layer_fmt = OUTPUT_FORMATS.get(fmt, fmt) if m is output_layer else fmt
        # int8 layers under int4 (the output layer) take `auto` activations, as `quantize_int4` makes them
        change += quantized_layer_bytes(layer_fmt, m.out_features, m.in_features,
                                        activations if fmt == "int8" else "auto", group_size)
        if id(m.weight) not in kept:
            change -= m.weight.numel() * m.weight.element_size()
    return change


def held_bytes(model: nn.Module) -> int:
    """Bytes a loaded model holds: its parameters and buffers, and the int8 weights PyTorch's engine packed."""
    tensors = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return tensors + sum(m.packed_bytes for m in model.modules() if isinstance(m, Int8Linear))


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of the linear layers, float, int8 or int4 with its scales (a tied output layer
    counted once per layer)."""
    total = 0
    for m in model.modules():
        if isinstance(m, (Int4Linear, BlockLinear)):
            total += m.weight_bytes()
        elif isinstance(m, Int8Linear):
            w = m.int8_weight()
            total += w.numel() * w.element_size()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
