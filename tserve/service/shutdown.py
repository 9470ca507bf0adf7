"""Graceful shutdown that a load balancer can follow.

On the first SIGTERM (or Ctrl-C) the server keeps listening but stops being ready: `/readyz` answers 503, so
Kubernetes takes the pod out of its Service, and new requests get 503 with Retry-After while the requests
the models hold run to their end. Once no model holds a request, or the drain time is up,
uvicorn's own shutdown closes the connections and the lifespan stops the engines. A second signal stops at
once.
"""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType

import uvicorn

from tserve.service.registry import ModelRegistry

log = logging.getLogger("tserve.shutdown")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, registry: ModelRegistry, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.registry, self.drain_timeout_s = registry, drain_timeout_s
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        log.info("draining", extra={"signal": sig, "timeout_s": self.drain_timeout_s})
        self.registry.begin_drain()
        self._drain = threading.Thread(target=self._exit_when_idle, name="drain", daemon=True)
        self._drain.start()

    def _exit_when_idle(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while not self.registry.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("drained", extra={"idle": self.registry.idle()})
        self.should_exit = True
