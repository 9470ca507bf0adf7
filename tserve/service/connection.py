"""Waiting on a worker for a client that may leave: what every non-streaming route and task uses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from tserve.service.engine import Worker
from tserve.service.errors import client_closed, engine_failure

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25


async def while_connected(request: Request | None, work: Awaitable[T]) -> T:
    """The result of `work`, unless the client goes away first: then `work` is cancelled (which cancels the
    engine requests and batch items it waits on, freeing their rows at the next step) and the answer is
    499. Every non-streaming route that waits on a worker runs its wait through here. Without a request (a
    file job, which outlives the upload that started it) the work is awaited until it ends or is cancelled."""
    if request is None:
        return await work
    task = asyncio.ensure_future(work)
    # Cancelled below when the client leaves; its outcome is then of no interest, but must be retrieved.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise client_closed()


async def run_job(request: Request | None, worker: Worker, what: str, invalid_code: str, fn: Callable[..., T],
                  *args: Any) -> T:
    """`fn(*args)` as a call job of the model's worker: in its queue (limits, deadline), in its thread (the
    device is never shared with a step), cancelled when the client leaves. Errors map like the engine's."""
    try:
        return await while_connected(request, worker.result(worker.call(fn, *args)))
    except Exception as exc:
        raise engine_failure(exc, what, invalid_code) from exc
