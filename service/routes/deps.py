"""Shared route helpers: the registry lookup, the readiness gate and SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request

from service.errors import APIError, bad_request, overloaded
from service.registry import ModelRegistry, ServedModel
from service.settings import Settings


def registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def settings(request: Request) -> Settings:
    return request.app.state.settings


def served_model(request: Request, name: str | None, task: str) -> ServedModel:
    """The model for this request; 503 while models are still loading."""
    reg = registry(request)
    if not reg.ready:
        if reg.error:
            raise APIError(503, f"models failed to load: {reg.error}", "server_error", "not_ready")
        raise overloaded("models are still loading", retry_after=5, status=503)
    return reg.get(name, task)


def check_count(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise bad_request(f"{n} {what} in one request; the limit is {limit}", "too_many_inputs")


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
