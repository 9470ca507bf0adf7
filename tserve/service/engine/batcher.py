"""Dynamic batching (as Triton / Ray Serve do it) on the shared scheduler: items arriving within
`max_wait_ms` of the oldest waiting one, up to `max_batch_size`, run together through a batch function in
the worker thread. Used for image classification. Queue limits, cancel, deadlines, drain and call jobs are
the `Worker`'s, the same as the engines'."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from tserve.service.engine.request import EngineRequest, Event, request_error
from tserve.service.engine.worker import Worker
from tserve.service.metrics import Metrics

log = logging.getLogger("tserve.batcher")

T = TypeVar("T")
R = TypeVar("R")


class BatchItem(EngineRequest, Generic[T]):
    def __init__(self, item: T, deadline: float) -> None:
        super().__init__(deadline)
        self.item = item


class DynamicBatcher(Worker, Generic[T, R]):
    """`await batcher.submit(item)` -> result of `batch_fn([... item ...])[i]`.

    `batch_fn` runs in the batcher's worker thread and returns one result (or an exception instance, which
    fails only that item) per input item. Where `batch_fn` raises, its items run again one by one: an item fails
    only with the error it raises alone, never with another client's.
    """

    reports_cache = False
    parts_take_turns = True
    thread_name = "batcher"

    def __init__(self, name: str, batch_fn: Callable[[list[T]], list[R | BaseException]], *, max_batch_size: int,
                 max_wait_ms: float, max_queue: int, metrics: Metrics, device: torch.device | None = None,
                 timeout_s: float = 600.0) -> None:
        super().__init__(name, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, capacity=max_batch_size)
        self.batch_fn = batch_fn
        self.device = device or torch.device("cpu")  # where batch_fn runs its model
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_ms / 1000.0
        self._taken = 0  # items admitted into the batch being formed
        self._loaded = False  # items arrived while the last batch ran: more are likely, worth waiting for

    # ----------------------------------------------------------------------------------------------
    # Event-loop side
    # ----------------------------------------------------------------------------------------------
    def submit_job(self, item: T, **part: Any) -> BatchItem[T]:
        req = BatchItem(item, time.perf_counter() + self.timeout_s)
        self._enqueue(req, **part)
        return req

    def enqueue(self, items: list[T]) -> list[BatchItem[T]]:
        """Queue all items or none (raises QueueFull); `await batcher.result(item)` for each later."""
        return self.submit_all(items)

    async def submit(self, item: T) -> R:
        return await self.result(self.enqueue([item])[0])

    # ----------------------------------------------------------------------------------------------
    # Worker thread
    # ----------------------------------------------------------------------------------------------
    @property
    def rows_in_use(self) -> int:
        # One batch at a time: while it runs, nothing else can start (--max-queue 0 refuses).
        return self.capacity if self.running else 0

    def step(self) -> None:
        if self._batch_ready():
            self._taken = 0
            super().step()

    def _batch_ready(self) -> bool:
        """A full batch waits, or the oldest item has waited max_wait, or the worker is shutting down, or
        nothing arrived while the last batch ran (no load: an item alone runs at once, with no wait); otherwise
        wait (a new item wakes the worker early) and let the loop ask again."""
        with self._lock:
            oldest = self.waiting[0].arrival if self.waiting else None
            full = len(self.waiting) >= self.max_batch_size
        if oldest is None or full or not self._loaded or self._draining or self._stop:
            return True
        left = oldest + self.max_wait_s - time.perf_counter()
        if left <= 0:
            return True
        self._wake.wait(timeout=left)
        self._wake.clear()
        return False

    def _reserve(self, req: BatchItem) -> bool:
        if self._taken >= self.max_batch_size:
            return False
        self._taken += 1
        return True

    def _release(self, req: BatchItem) -> None:
        pass

    def _prefill(self, reqs: list[BatchItem]) -> None:
        self.m.batch_size.observe(len(reqs))
        try:
            results: list[Any] = self.batch_fn([r.item for r in reqs])
        except Exception as exc:  # the batcher keeps going; an item that fails alone fails alone
            if len(reqs) == 1:
                log.exception("batch failed", extra={"model": self.name, "size": 1})
                results = [request_error(exc)]
            else:
                log.warning("batch failed; running its items one by one", extra={"model": self.name,
                                                                                  "size": len(reqs)})
                results = [self._alone(r.item) for r in reqs]
        outcome = {id(r): x for r, x in zip(reqs, results, strict=True)}

        def finish(req: BatchItem) -> None:
            result = outcome[id(req)]
            self._finish(req, Event(error=result) if isinstance(result, BaseException)
                         else Event(finish_reason="stop", result=result))

        self._each(reqs, finish)
        self._loaded = bool(self.waiting)

    def _alone(self, item: T) -> Any:
        """`batch_fn` of one item: its result, or the error it fails with."""
        try:
            return self.batch_fn([item])[0]
        except Exception as exc:
            log.exception("batch failed", extra={"model": self.name, "size": 1})
            return request_error(exc)

    def _decode(self) -> None:
        pass  # every item of a batch finishes in the step that ran it
