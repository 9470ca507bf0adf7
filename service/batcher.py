"""Dynamic batching (as Triton / Ray Serve do it): items arriving within `max_wait_ms` of the first one,
up to `max_batch_size`, run together through a batch function in a worker thread. Used for
image classification."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from model.checkpoint import select_device
from service.engine import QueueFull, request_error
from service.metrics import Metrics

log = logging.getLogger("tserve.batcher")

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T]):
    item: T
    future: Future = field(default_factory=Future)
    cancelled: bool = False


class DynamicBatcher(Generic[T, R]):
    """`await batcher.submit(item)` -> result of `batch_fn([... item ...])[i]`.

    `batch_fn` runs in the batcher's worker thread and returns one result (or an exception instance, which
    fails only that item) per input item. An exception raised by `batch_fn` fails the whole batch.
    """

    def __init__(self, name: str, batch_fn: Callable[[list[T]], list[R | BaseException]], *, max_batch_size: int,
                 max_wait_ms: float, max_queue: int, metrics: Metrics, device: torch.device | None = None) -> None:
        self.name, self.batch_fn = name, batch_fn
        self.device = device or torch.device("cpu")  # where batch_fn runs its model
        self.max_batch_size, self.max_wait_s, self.max_queue = max_batch_size, max_wait_ms / 1000.0, max_queue
        self.metrics = metrics
        self.m = metrics.for_model(name)
        self._queue: list[_Pending[T]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._draining = False
        self._running = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"batcher-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Graceful shutdown: refuse new items, finish the queued ones (up to the timeout), then stop."""
        self.refuse_new()
        deadline = time.monotonic() + drain_timeout_s
        while (self._queue or self._running) and self._thread is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def refuse_new(self) -> None:
        """Start shutting down: new items are refused from now on; queued and running ones go on."""
        self._draining = True

    @property
    def idle(self) -> bool:
        return not self._queue and not self._running

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return self._running

    def enqueue(self, items: list[T]) -> list[_Pending[T]]:
        """Queue all items or none (raises QueueFull); `await batcher.result(pending)` for each later."""
        pending = [_Pending(item) for item in items]
        with self._cond:
            if self._draining:
                raise QueueFull(f"model {self.name!r} is shutting down")
            if self.max_queue == 0:  # no waiting room: only what the idle worker's next batch takes
                if self._running or len(self._queue) + len(items) > self.max_batch_size:
                    raise QueueFull(f"model {self.name!r} is busy and has no waiting room; retry later")
            elif len(self._queue) + len(items) > self.max_queue:
                raise QueueFull(f"model {self.name!r} has {len(self._queue)} items waiting; retry later")
            self._queue.extend(pending)
            self.m.queue_depth.set(len(self._queue))
            self._cond.notify()
        return pending

    async def result(self, pending: _Pending[T]) -> R:
        try:
            return await asyncio.wrap_future(pending.future)
        except asyncio.CancelledError:
            pending.cancelled = True  # skipped if it has not started yet
            raise

    async def submit(self, item: T) -> R:
        return await self.result(self.enqueue([item])[0])

    def _take_batch(self) -> list[_Pending[T]]:
        """Wait for a first item, then up to max_wait for more, up to max_batch_size."""
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait(timeout=0.5)
            if self._stop:
                return []
            deadline = time.monotonic() + self.max_wait_s
            while len(self._queue) < self.max_batch_size and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            taken, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size :]
            # An item whose waiter has gone is dropped, not computed; the others' futures are marked running,
            # so that a waiter cancelled from now on cannot cancel them under the worker's `set_result`.
            batch = [p for p in taken if not p.cancelled and p.future.set_running_or_notify_cancel()]
            self.m.queue_depth.set(len(self._queue))
            return batch

    def _loop(self) -> None:
        select_device(self.device)
        while True:
            batch = self._take_batch()
            if self._stop:
                for p in batch + self._queue:
                    if not p.future.done():  # a cancelled waiter's future is done already
                        p.future.set_exception(RuntimeError("server shutting down"))
                return
            if not batch:
                continue
            self._running = len(batch)
            self.m.running.set(len(batch))
            self.m.batch_size.observe(len(batch))
            try:
                results: list[Any] = self.batch_fn([p.item for p in batch])
            except Exception as exc:  # the batch fails, the batcher keeps going
                log.exception("batch failed", extra={"model": self.name, "size": len(batch)})
                results = [request_error(exc)] * len(batch)
            for p, r in zip(batch, results, strict=True):
                if isinstance(r, BaseException):
                    p.future.set_exception(r)
                else:
                    p.future.set_result(r)
            self._running = 0
            self.m.running.set(0)
