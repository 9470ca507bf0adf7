"""Shared route helpers: the registry lookup, the readiness gate and SSE framing."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from fastapi import Request

from model.attention_maps import check_selection
from service.errors import APIError, bad_request, overloaded
from service.registry import ModelRegistry
from service.schemas import AttentionSelection
from service.settings import Settings
from service.tasks import ServedModel


def registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def settings(request: Request) -> Settings:
    return request.app.state.settings


def ready_registry(request: Request) -> ModelRegistry:
    """The registry once its models serve; 503 while they are still loading, and once shutting down."""
    reg = registry(request)
    if not reg.ready:
        if reg.draining:
            raise overloaded("the server is shutting down; retry later", retry_after=5, status=503)
        if reg.error:
            raise APIError(503, f"models failed to load: {reg.error}", "server_error", "not_ready")
        raise overloaded("models are still loading", retry_after=5, status=503)
    return reg


def served_model(request: Request, name: str | None, task: str | None) -> ServedModel:
    """The model for this request (`task` None: any task, by name); 503 until the models serve."""
    return ready_registry(request).get(name, task)


log = logging.getLogger("tserve.requests")

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


def attention_selection(served: ServedModel, selection: AttentionSelection | None, stream: bool, outputs: int,
                        queries: int, keys: int, limit: int) -> tuple[list[int], list[int]] | None:
    """Validate a `return_attention` extension up front: (layers, heads), or None when not asked for.
    The weight count is bounded before generating (`outputs` sequences of at most `queries` x `keys`)."""
    if selection is None:
        return None
    if stream:
        raise bad_request("return_attention needs stream false", "stream_unsupported")
    try:
        layers, heads = check_selection(served.loaded, selection.layers, selection.heads)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_attention_request") from exc
    floats = outputs * served.generated_attention_modules * len(layers) * len(heads) * queries * keys
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
