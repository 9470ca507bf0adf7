"""`tserve serve` with test-only hooks, for tests that need a server that is slow, stuck or failing on
purpose. Each hook is set by an environment variable that only this launcher reads; the service itself has
no such settings. Run as `python -m tests.helpers.hooked_server serve ...` from the repository root, or through
`server.ServerProcess(..., hooks={...})` / `step_delay_s=...`.

- TSERVE_TEST_STEP_DELAY_S=SECONDS: every engine step first sleeps this long, so that requests are still
  running when a test acts on them.
- TSERVE_TEST_BATCH_DELAY_S=SECONDS: every classification batch first sleeps this long.
- TSERVE_TEST_LOAD_GATE=PATH: model loading starts only once the file PATH exists (the server answers
  HTTP meanwhile, not ready).
- TSERVE_TEST_OOM_MARKER=TEXT: a language-model decode step whose batch holds a request whose prompt
  contains TEXT, and which has generated 2 tokens or more, raises `torch.cuda.OutOfMemoryError`.
- TSERVE_TEST_SLOW_MARKER=TEXT, TSERVE_TEST_SLOW_STEP_S=SECONDS: a language-model decode step whose batch
  holds a request whose prompt contains TEXT sleeps SECONDS first.

`slow_steps` is the in-process form of the first hook.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch

from tserve.service.cli import main  # noqa: E402
from tserve.service.engine import (  # noqa: E402
    GenerationEngine,
    GenerationRequest,
    Worker,  # noqa: E402
)
from tserve.service.registry import ModelRegistry  # noqa: E402
from tserve.service.vision.images import Classifier  # noqa: E402


def slow_steps(target: Worker | type[Worker], seconds: float,
               released: threading.Event | None = None) -> Worker | type[Worker]:
    """Make every step of `target` (an engine, or the class: every engine) sleep `seconds` first, so that a
    request of many tokens is still running when a test acts on it; once `released` is set, no more (the test
    has acted and waits for the results)."""
    original = target.step
    pause = (lambda: released.wait(seconds)) if released is not None else (lambda: time.sleep(seconds))
    if isinstance(target, type):
        def step(self: Worker) -> None:
            pause()
            original(self)
    else:
        def step() -> None:
            pause()
            original()
    target.step = step
    return target


def _holds(engine: GenerationEngine, reqs: list[GenerationRequest], marker: str) -> list[GenerationRequest]:
    return [r for r in reqs if marker in engine.tokenizer.decode(r.prompt_ids)]


def install(env: dict[str, str]) -> None:
    if delay := float(env.get("TSERVE_TEST_STEP_DELAY_S", "0")):
        slow_steps(Worker, delay)
    if batch_delay := float(env.get("TSERVE_TEST_BATCH_DELAY_S", "0")):
        run_batch = Classifier.run_batch

        def slow_run_batch(self: Classifier, pixels: list[torch.Tensor]) -> list:
            time.sleep(batch_delay)
            return run_batch(self, pixels)

        Classifier.run_batch = slow_run_batch
    if gate := env.get("TSERVE_TEST_LOAD_GATE"):
        load_all = ModelRegistry._load_all

        def gated_load_all(self: ModelRegistry) -> None:
            while not Path(gate).exists():
                time.sleep(0.02)
            load_all(self)

        ModelRegistry._load_all = gated_load_all

    oom, slow = env.get("TSERVE_TEST_OOM_MARKER"), env.get("TSERVE_TEST_SLOW_MARKER")
    slow_s = float(env.get("TSERVE_TEST_SLOW_STEP_S", "0"))
    if oom or slow:
        decode_forward = GenerationEngine._decode_forward

        def faulty_decode_forward(self: GenerationEngine, reqs: list[GenerationRequest]) -> torch.Tensor:
            if slow and _holds(self, reqs, slow):
                time.sleep(slow_s)
            if oom and any(len(r.generated) >= 2 for r in _holds(self, reqs, oom)):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return decode_forward(self, reqs)

        GenerationEngine._decode_forward = faulty_decode_forward


if __name__ == "__main__":
    install(dict(os.environ))
    sys.exit(main())
