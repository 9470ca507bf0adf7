"""Linear layers with their weights laid out once, at load, in oneDNN's blocked format for this CPU.
`F.linear` re-packs a float32 weight on every call; for decode steps (a few rows against a 512x2048 weight)
that re-packing is a large part of the GEMM. The packed product also gives each row the same result whatever
the number of rows, where `F.linear` switches kernels below 16 rows. Inference only (no autograd), float32
on the CPU; anything else keeps `nn.Linear`."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a pre-packed weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
