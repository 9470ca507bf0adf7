"""The garbage collector while serving: the start-up heap frozen out of its reach, and its pauses measured.

A full (generation 2) collection stops every thread of the process, the engine's included, for as long as it takes
to walk every container object alive: after loading models, their modules, tokenizers and the libraries' objects
are a few hundred thousand, and one such collection took 120-150 ms (docs/benchmarks/gpu.md), a stall of every
stream. Those objects live until the process ends, so `freeze` moves them to the collector's permanent generation
once the models are loaded and warmed up (`gc.freeze`, as vLLM does after its warm-up): a full collection then
walks only what serving allocated since. Objects in the permanent generation are still freed by their reference
counts; only their reference cycles wait for `thaw` (a model unloaded, the server stopping).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

log = logging.getLogger("tserve.heap")


def freeze() -> None:
    """Collect what is garbage now, then put every object still alive out of the collector's reach."""
    gc.collect()
    gc.freeze()
    log.info("heap frozen", extra={"frozen_objects": gc.get_freeze_count()})


def thaw() -> None:
    """Give the frozen objects back to the collector (the next collection may free their cycles)."""
    gc.unfreeze()


class PauseObserver:
    """Records each collection's duration in `histogram` (a Prometheus histogram with a `generation` label)
    through `gc.callbacks`, until `close`."""

    def __init__(self, histogram: Any) -> None:
        self._children = [histogram.labels(str(g)) for g in range(3)]
        self._started: dict[int, float] = {}  # by thread: a collection runs in the thread that triggered it
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started[threading.get_ident()] = time.perf_counter()
        elif (start := self._started.pop(threading.get_ident(), None)) is not None:
            self._children[info["generation"]].observe(time.perf_counter() - start)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
