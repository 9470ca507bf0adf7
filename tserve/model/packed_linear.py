"""Linear layers with their weights laid out once, at load, in oneDNN's blocked format for this CPU.
`F.linear` re-packs a float32 weight on every call; for decode steps (a few rows against a 512x2048 weight)
that re-packing is a large part of the GEMM. The packed product also gives each row the same result whatever
the number of rows, where `F.linear` switches kernels below 16 rows. Inference only (no autograd), float32
on the CPU; anything else keeps `nn.Linear`.

A model whose decode steps run in one C++ call (`fused_decode`) reads its float32 weights as `nn.Linear` stores
them, so they are not packed; its other products (prefill's) still run on oneDNN (`OneDNNLinear`), which lays
the weight out on each call: `F.linear` is MKL's GEMM, 2-3x slower than oneDNN's on an AMD EPYC (128 rows of
SmolLM2-135M's and GPT-2 small's shapes: a 128-token prompt 77 against 31 ms), level with it on an Intel Xeon."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T + b by oneDNN's GEMM, on a weight it packed (`PackedLinear`) or as stored (`OneDNNLinear`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a pre-packed weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return _onednn_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class OneDNNLinear(nn.Linear):
    """`nn.Linear` whose forward is oneDNN's GEMM on the weight as stored (laid out per call); the weight stays the
    module's own, for `fused_decode` to read. A row's result is the same in any batch."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:  # oneDNN's op has no backward
            return super().forward(x)
        if x.numel() != self.in_features:
            return _onednn_linear(x, self.weight, self.bias)
        # One row takes another oneDNN kernel than two or more, which rounds otherwise: the row twice.
        twice = _onednn_linear(x.reshape(1, -1).expand(2, -1).contiguous(), self.weight, self.bias)
        return twice[:1].reshape(*x.shape[:-1], self.out_features)


def can_pack(model: nn.Module) -> bool:
    first = next(model.parameters())
    return first.device.type == "cpu" and first.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of a float32 CPU `model` in place (a no-op elsewhere); returns how many.
    The model is for inference from then on."""
    if not can_pack(model):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
                count += 1
    return count


def onednn_linears(model: nn.Module) -> int:
    """Make every `nn.Linear` of a float32 CPU `model` a `OneDNNLinear` in place, its parameters the same tensors
    (a no-op elsewhere); returns how many."""
    if not can_pack(model):
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for linear in linears:
        linear.__class__ = OneDNNLinear  # the same module, the same weight: only its forward changes
    return len(linears)
