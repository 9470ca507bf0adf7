"""Shared route helpers: the registry lookup, the readiness gate and SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from model.attention_maps import check_selection
from model.checkpoint import LoadedModel
from service.engine import Scheduler
from service.errors import APIError, bad_request, client_closed, engine_failure, overloaded
from service.registry import ModelRegistry, ServedModel
from service.schemas import AttentionSelection
from service.settings import Settings


def registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def settings(request: Request) -> Settings:
    return request.app.state.settings


def served_model(request: Request, name: str | None, task: str) -> ServedModel:
    """The model for this request; 503 while models are still loading, and once shutting down."""
    reg = registry(request)
    if not reg.ready:
        if reg.draining:
            raise overloaded("the server is shutting down; retry later", retry_after=5, status=503)
        if reg.error:
            raise APIError(503, f"models failed to load: {reg.error}", "server_error", "not_ready")
        raise overloaded("models are still loading", retry_after=5, status=503)
    return reg.get(name, task)


log = logging.getLogger("tserve.requests")

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25


async def while_connected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, unless the client goes away first: then `work` is cancelled (which cancels the
    engine requests and batcher items it waits on, freeing their rows at the next step) and the answer is
    499. Every non-streaming route that waits on an engine or the batcher runs its wait through here."""
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


async def run_job(request: Request, worker: Scheduler, what: str, invalid_code: str, fn: Callable[..., T],
                  *args: Any) -> T:
    """`fn(*args)` as a call job of the model's worker: in its queue (limits, deadline), in its thread (the
    device is never shared with a step), cancelled when the client leaves. Errors map like the engine's."""
    try:
        return await while_connected(request, worker.result(worker.call(fn, *args)))
    except Exception as exc:
        raise engine_failure(exc, what, invalid_code) from exc


def log_inputs(request: Request, texts: list[str]) -> None:
    """User text goes to the logs only when the operator opted in (TSERVE_LOG_PROMPTS)."""
    if settings(request).log_prompts:
        log.info("inputs", extra={"request_id": getattr(request.state, "request_id", None), "inputs": texts})


def check_max_tokens(max_tokens: int, limit: int) -> None:
    """`--max-tokens-limit`, the same for every route that takes `max_tokens`."""
    if max_tokens > limit:
        raise bad_request(f"max_tokens {max_tokens} exceeds the server's limit of {limit}", "max_tokens_too_large")


def check_count(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise bad_request(f"{n} {what} in one request; the limit is {limit}", "too_many_inputs")


def attention_selection(loaded: LoadedModel, selection: AttentionSelection | None, stream: bool, outputs: int,
                        queries: int, keys: int, limit: int) -> tuple[list[int], list[int]] | None:
    """Validate a `return_attention` extension up front: (layers, heads), or None when not asked for.
    The weight count is bounded before generating (`outputs` sequences of at most `queries` x `keys`)."""
    if selection is None:
        return None
    if stream:
        raise bad_request("return_attention needs stream false", "stream_unsupported")
    try:
        layers, heads = check_selection(loaded, selection.layers, selection.heads)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_attention_request") from exc
    modules = 2 if loaded.task == "translation" else 1  # decoder.self (+ decoder.cross)
    floats = outputs * modules * len(layers) * len(heads) * queries * keys
    if floats > limit:
        raise bad_request(f"return_attention could return up to {floats} weights; the limit is {limit}: select "
                          "fewer layers or heads, or lower max_tokens", "too_many_weights")
    return layers, heads


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
