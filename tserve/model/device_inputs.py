"""Small tensors built on the host (row indices, per-row parameters, the tokens of a step) on their way to the
model's device without the host waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits until the device has run
everything queued before the copy: an engine that prepares step n+1 while step n runs would stall on every such
tensor. Through pinned memory the copy is asynchronous and ordered on the stream after the work already queued
(PyTorch keeps the pinned block until the copy has run)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(values: Sequence | float | int | Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` (or a host tensor's copy), without a host sync on CUDA."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
