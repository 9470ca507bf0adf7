"""int8 weights for the linear layers of any of the three model kinds, through PyTorch's own dynamic
quantization: each `nn.Linear` becomes a quantized Linear that holds its weight as int8 with one scale per
output channel and quantizes its input per batch on the fly (fbgemm / onednn GEMMs). Embeddings, norms and the
KV cache stay in float32. CPU only: PyTorch has no CUDA kernel for these modules (on a GPU, bfloat16 is the
smaller type to use)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8")


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of a float32 CPU `model` in place; returns it."""
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        raise ValueError(f"int8 weights need a float32 model on the CPU (got {first.dtype} on {first.device}): "
                         "PyTorch's dynamic int8 kernels are CPU kernels")
    with warnings.catch_warnings():  # the eager-mode API is deprecated in favour of torchao, not removed
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic  # noqa: PLC0415

        # One scale per output channel: on the bundled translator's test slice it keeps chrF within 0.1 of
        # float32, where one scale per tensor loses 0.6.
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)


def is_int8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear" and type(module).__module__.startswith("torch.ao.nn.quantized")


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of the linear layers, float or int8 (a tied output layer counted once per layer)."""
    total = 0
    for m in model.modules():
        if is_int8_linear(m):
            w = m.weight()
            total += w.numel() * w.element_size()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
