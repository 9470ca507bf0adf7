"""Decode steps at fixed batch sizes, replayed from CUDA graphs.

At GPT-2-small size a decode step is a few hundred small kernels; launching them from Python costs far more
than running them. A decode step over the static KV cache has static shapes as long as the batch size is
fixed and the step attends over the whole cache (the causal mask, or the flash decode kernel's per-sequence
lengths, leave out the unused positions). So batches are padded up to the next of a few bucket sizes, and
each bucket's step is captured once as a CUDA graph and replayed with new inputs copied into its static
buffers. Padding rows point at a scratch cache slot that no request owns, so whatever they write is never
read.

The same padding runs eagerly on the CPU, which is how the test suite checks that a padded step gives every
real row exactly the logits of an unpadded one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger("tserve.cuda_graphs")

StepFn = Callable[..., Tensor]


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch` (padding wastes at most 7 rows past 8)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 8, 8))
    return sorted({min(b, max_batch) for b in sizes})


class BucketedDecode:
    """Runs `step(*inputs)` (every input a (B,) tensor, output (B, ...)) at the smallest bucket size >= B,
    padding input i with `pad_values[i]`; with `use_graphs` (CUDA only), each bucket is a CUDA graph.

    Batches larger than the largest bucket run eagerly at their own size.
    """

    def __init__(
        self,
        step: StepFn,
        pad_values: Sequence[int],
        buckets: Sequence[int],
        device: torch.device | str,
        *,
        use_graphs: bool = False,
        dtype: torch.dtype = torch.long,
    ) -> None:
        self.step = step
        self.pad_values = list(pad_values)
        self.buckets = sorted(set(buckets))
        self.device = torch.device(device)
        if use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.use_graphs = use_graphs
        self._inputs = {
            b: [torch.full((b,), pad, dtype=dtype, device=self.device) for pad in self.pad_values]
            for b in self.buckets
        }
        # Host staging buffers in pinned memory, so the copy to the device is asynchronous.
        pin = self.device.type == "cuda"
        self._staging = [torch.empty(max(self.buckets), dtype=dtype, pin_memory=pin) for _ in self.pad_values]
        # Marks when the last asynchronous copy out of the staging buffers has finished, so that they are not
        # overwritten while a copy may still be reading them.
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Tensor] = {}

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (largest first, so smaller graphs reuse its memory pool)."""
        if not self.use_graphs or self._graphs:
            return
        # Streams of the model's device, named explicitly: the capture must not happen on whatever device is
        # current in this thread (a graph captured on another device than its tensors' replays nothing).
        with torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()
            warm = torch.cuda.Stream(self.device)
            warm.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(warm):  # first runs outside the graph: lazy init, autotuning, allocator
                for b in self.buckets:
                    self.step(*self._inputs[b])
            torch.cuda.current_stream(self.device).wait_stream(warm)
            capture = torch.cuda.Stream(self.device)
            for b in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture):
                    self._outputs[b] = self.step(*self._inputs[b])
                self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode graphs", extra={"buckets": self.buckets})

    def __call__(self, *inputs: Sequence[int] | Tensor) -> Tensor:
        """Inputs as lists of ints (copied through pinned memory) or (B,) tensors. Returns the output rows
        of the real batch; with graphs it is a view of a static buffer, valid until the next call."""
        n = len(inputs[0])
        b = self.bucket(n)
        if b is None:
            return self.step(*(self._to_device(x) for x in inputs))
        bufs = self._inputs[b]
        if self._copied is not None:
            self._copied.synchronize()
        for buf, stage, x, pad in zip(bufs, self._staging, inputs, self.pad_values, strict=True):
            if isinstance(x, Tensor):
                buf[:n].copy_(x, non_blocking=True)
            else:
                stage[:n] = torch.as_tensor(x, dtype=stage.dtype)
                buf[:n].copy_(stage[:n], non_blocking=True)
            if n < b:
                buf[n:].fill_(pad)
        if self._copied is not None:
            self._copied.record()
        if self.use_graphs:
            self.capture()
            self._graphs[b].replay()
            return self._outputs[b][:n]
        return self.step(*bufs)[:n]

    def _to_device(self, x: Sequence[int] | Tensor) -> Tensor:
        return x.to(self.device) if isinstance(x, Tensor) else torch.tensor(list(x), device=self.device)
