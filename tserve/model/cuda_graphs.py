"""Decode steps at fixed batch sizes, replayed from CUDA graphs.

At GPT-2-small size a decode step is a few hundred small kernels; launching them from Python costs far more
than running them. A decode step over the static KV cache has static shapes as long as the batch size is
fixed and the step attends over the whole cache (the causal mask, or the flash decode kernel's per-sequence
lengths, leave out the unused positions). So batches are padded up to the next of a few bucket sizes, and
each bucket's step is captured once as a CUDA graph and replayed with new inputs copied into its static
buffers. Padding rows point at a scratch cache slot that no request owns, so whatever they write is never
read.

A speculative step (each row's next token and its draft, `DecodeAhead`) is padded the same way, and also in
width: every row feeds the captured number of positions.

The same padding runs eagerly on the CPU, which is how the test suite checks that a padded step gives every
real row exactly the logits of an unpadded one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from tserve.model.decoder import Decoder
    from tserve.model.kv_cache import PagedKVCache

log = logging.getLogger("tserve.cuda_graphs")

StepFn = Callable[..., Tensor]


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch` (padding wastes at most 7 rows past 8)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 8, 8))
    return sorted({min(b, max_batch) for b in sizes})


class BucketedDecode:
    """Runs `step(*inputs)` (input i a (B, *shapes[i]) tensor, default (B,); output (B, ...)) at the smallest
    bucket size >= B, padding input i with `pad_values[i]`; with `use_graphs` (CUDA only), each bucket is a CUDA
    graph.

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
        shapes: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        self.step = step
        self.pad_values = list(pad_values)
        shapes = list(shapes) if shapes is not None else [()] * len(self.pad_values)
        self.buckets = sorted(set(buckets))
        self.device = torch.device(device)
        if use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.use_graphs = use_graphs
        self._inputs = {
            b: [torch.full((b, *shape), pad, dtype=dtype, device=self.device)
                for pad, shape in zip(self.pad_values, shapes, strict=True)]
            for b in self.buckets
        }
        # Host staging buffers in pinned memory, so the copy to the device is asynchronous.
        pin = self.device.type == "cuda"
        self._staging = [torch.empty(max(self.buckets), *shape, dtype=dtype, pin_memory=pin) for shape in shapes]
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
        """Inputs as (nested) lists of ints (copied through pinned memory) or tensors. Returns the output rows
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


class DecodeAhead:
    """Speculative steps of a `Decoder` (each row feeds its next token, then its draft) at static shapes: every
    row is padded to `width` positions, the batch to a bucket of up to `max_rows` rows, and the step attends
    over the rows' whole tables (the causal mask from the positions leaves out the rest). With `use_graphs`
    (CUDA only) each bucket is a CUDA graph.

    Where the padding writes: a row's padding positions follow its real ones, so each one lies in the row's
    own last block past what it has written (read by no one: the next step that feeds that position writes it
    first), or past the blocks the row holds, where its table names the null block. Padding rows use the
    cache's spare row (`cache.num_rows`), whose table is all null blocks. A step whose padding would pass
    `max_positions` (a position the model has no embedding for) does not fit: it runs eagerly instead.
    """

    def __init__(self, model: Decoder, cache: PagedKVCache, *, width: int, max_rows: int, max_positions: int,
                 use_graphs: bool) -> None:
        self.width, self.max_positions = width, max_positions
        self.bucketed = BucketedDecode(
            lambda tokens, positions, rows: model.decode_tokens(tokens, positions, cache, rows, kv_len=cache.max_len),
            pad_values=(0, 0, cache.num_rows), buckets=default_buckets(max_rows), device=cache.k.device,
            use_graphs=use_graphs, shapes=((width,), (width,), ()),
        )

    def fits(self, starts: Sequence[int], widths: Sequence[int]) -> bool:
        """Whether rows feeding `widths[i]` tokens from position `starts[i]` run here: a bucket holds them,
        no row feeds more than `width` and no row's padding passes `max_positions`."""
        return (len(starts) <= self.bucketed.buckets[-1] and max(widths) <= self.width
                and max(starts) + self.width <= self.max_positions)

    def capture(self) -> None:
        self.bucketed.capture()

    def __call__(self, fed: Sequence[Sequence[int]], starts: Sequence[int], rows: Sequence[int]) -> Tensor:
        """Logits (B, T, V) of rows `rows` feeding `fed[i]` from position `starts[i]`, T = the longest feed
        (a row's positions past its own feed are padding); with graphs a view of a static buffer."""
        W = self.width
        tokens = [list(f) + [0] * (W - len(f)) for f in fed]
        positions = [list(range(p, p + W)) for p in starts]  # padding past the feed: see the class's note
        return self.bucketed(tokens, positions, rows)[:, : max(map(len, fed))]
