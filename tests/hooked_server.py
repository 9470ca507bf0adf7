"""`tserve serve` with test-only hooks, for tests that need a server whose requests are still running
when they act. Set through environment variables that only this launcher reads; the service itself has no
such settings.

- TSERVE_TEST_STEP_DELAY_S: every engine step first sleeps this long.

Run as `python tests/hooked_server.py serve ...` (see `server.ServerProcess(..., hooks=...)`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.cli import main  # noqa: E402
from service.engine import StepEngine  # noqa: E402


def slow_steps(target: StepEngine | type[StepEngine], seconds: float) -> StepEngine | type[StepEngine]:
    """Make every step of `target` (an engine, or the class: every engine) sleep `seconds` first, so that a
    request of many tokens is still running when a test acts on it."""
    original = target.step
    if isinstance(target, type):
        def step(self: StepEngine) -> None:
            time.sleep(seconds)
            original(self)
    else:
        def step() -> None:
            time.sleep(seconds)
            original()
    target.step = step
    return target


if __name__ == "__main__":
    if delay := float(os.environ.get("TSERVE_TEST_STEP_DELAY_S", "0")):
        slow_steps(StepEngine, delay)
    sys.exit(main())
