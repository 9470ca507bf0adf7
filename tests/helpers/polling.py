"""Waiting for a worker thread to reach a state, instead of sleeping for a time that a loaded machine may
not keep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    """Return once `condition()` holds; fail the test if it never does within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.005)
