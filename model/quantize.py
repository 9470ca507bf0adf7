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
  float32's, against 78% with PyTorch's default (one 7-bit scale per batch; docs/BENCHMARKS.md)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

QUANTIZATIONS = ("none", "int8")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(word for line in text.splitlines() if line.startswith("flags") for word in line.split())


def full_range_activations() -> bool:
    """Whether 8-bit (not 7-bit) activations are safe: without VNNI, fbgemm multiplies u8 by s8 in pairs summed
    into saturating int16 (`vpmaddubsw`), which only 7-bit inputs keep from overflowing; VNNI (and AMX)
    accumulate in int32. This is the reason PyTorch's own dynamic Linear always passes `reduce_range=True`."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & _cpu_flags())


class Int8Linear(nn.Module):
    """`nn.Linear`'s forward with an int8 weight (one scale per output channel) and int8 activations (one
    scale per row)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao, not removed
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0,
                                                 torch.qint8)
        # Packed for the default engine (fbgemm on x86). oneDNN's GEMM uses AMX where the CPU has it and is 2x
        # faster from about 32 rows, but 1.2-1.8x slower below 16 (one request's decode steps); one engine for
        # every row count, since the two round their outputs differently and a row must get the same numbers
        # in any batch.
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        # Σ_k W[n, k] of the int8 weight as the GEMM sees it: the term that restores each row's minimum.
        self.register_buffer("weight_row_sums", qweight.dequantize().sum(dim=1).unsqueeze(0), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)
        self.reduce_range = not full_range_activations()

    def int8_weight(self) -> Tensor:
        return torch.ops.quantized.linear_unpack(self._packed)[0]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        # amin + amax: two passes, yet several times faster than `torch.aminmax` over the last dimension.
        low, high = rows.amin(dim=-1, keepdim=True), rows.amax(dim=-1, keepdim=True)
        span = (high - low).clamp_(min=1e-12)
        # (x - min) / span puts each row's own extremes exactly at 0 and 1 (a constant row is all 0).
        unit = (rows - low).div_(span)
        product = torch.ops.quantized.linear_dynamic(unit, self._packed, reduce_range=self.reduce_range)
        out = low * self.weight_row_sums if self.bias is None else torch.addcmul(self.bias, low, self.weight_row_sums)
        out.addcmul_(product, span)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of a float32 CPU `model` in place; returns it. Inference only."""
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        raise ValueError(f"int8 weights need a float32 model on the CPU (got {first.dtype} on {first.device}): "
                         "PyTorch's dynamic int8 kernels are CPU kernels")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child))
    return model


def is_int8_linear(module: nn.Module) -> bool:
    return isinstance(module, Int8Linear)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of the linear layers, float or int8 (a tied output layer counted once per layer)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            w = m.int8_weight()
            total += w.numel() * w.element_size()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
