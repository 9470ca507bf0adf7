"""Shared route helpers: the registry lookup, the readiness gate and SSE framing."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from tserve.model.attention_maps import check_selection
from tserve.service import limits
from tserve.service.engine import admission
from tserve.service.errors import APIError, InvalidInput, bad_request, overloaded
from tserve.service.registry import ModelRegistry
from tserve.service.schemas import AttentionSelection
from tserve.service.settings import Settings
from tserve.service.tasks import ServedModel
from tserve.service.vision.served import decode_base64

Body = TypeVar("Body", bound=BaseModel)


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


def served_model(request: Request, name: str | None, task: str | None, priority: int | None = None) -> ServedModel:
    """The model for this request (`task` None: any task, by name); 503 until the models serve. `priority`:
    the body's (`prioritise`)."""
    prioritise(priority)
    return ready_registry(request).get(name, task)


def prioritise(priority: int | None) -> None:
    """The body's priority, which this request's engine work is admitted at: no earlier than its key's, when the
    operator gave the key one (`KEY:N`)."""
    if priority is not None:
        current = admission.get()
        floor = current.floor if current.floor is not None else priority
        admission.set(replace(current, priority=max(priority, floor)))


log = logging.getLogger("tserve.requests")

def log_inputs(request: Request, texts: list[str]) -> None:
    """User text goes to the logs only when the operator opted in (TSERVE_LOG_PROMPTS)."""
    if settings(request).log_prompts:
        log.info("inputs", extra={"request_id": getattr(request.state, "request_id", None), "inputs": texts})


def _openai_style(check: Callable[..., None], *args: Any) -> None:
    """A shared limit (`service.limits`) as an OpenAI-style 400."""
    try:
        check(*args)
    except InvalidInput as exc:
        raise bad_request(str(exc), exc.code) from exc


def check_max_tokens(max_tokens: int, limit: int) -> None:
    _openai_style(limits.check_max_tokens, max_tokens, limit)


def check_count(what: str, n: int, limit: int) -> None:
    _openai_style(limits.check_input_count, n, limit, what)


def check_chars(text: str, limit: int, what: str = "the prompt") -> None:
    _openai_style(limits.check_input_chars, text, limit, what)


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


# --------------------------------------------------------------------------------------------------
# Bodies that carry images: JSON with base64, or multipart uploads
# --------------------------------------------------------------------------------------------------
def validated(schema: type[Body], data: dict[str, Any]) -> Body:
    """`data` as `schema`, its errors reported like FastAPI's own (422)."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from exc


async def image_body(request: Request, schema: type[Body], fields: tuple[str, ...],
                     max_images: int) -> tuple[Body, list[bytes] | None]:
    """The request as `schema`: from JSON (uploads None), or from a multipart form whose `fields` fill the body
    and whose `file` parts (at least one, at most `max_images`) are returned read."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=max_images + 1, max_fields=16)
        except Exception as exc:  # malformed multipart bodies
            if isinstance(exc, APIError):
                raise
            raise bad_request(f"malformed multipart body: {exc}", "invalid_multipart") from exc
        files = [f for f in form.getlist("file") if isinstance(f, UploadFile)]
        body = validated(schema, {k: v for k, v in form.items() if k in fields and isinstance(v, str)})
        if not files:
            raise bad_request("multipart requests need at least one 'file' part", "missing_image")
        check_count("images", len(files), max_images)
        return body, [await f.read() for f in files]
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON ({exc})", "invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", "invalid_json")
    return validated(schema, data), None


def base64_images(values: list[str], max_images: int) -> list[bytes]:
    """JSON's base64 images (plain or data URLs), at most `max_images`; a 400 names the one that is not base64."""
    check_count("images", len(values), max_images)
    blobs = []
    for i, value in enumerate(values):
        try:
            blobs.append(decode_base64(value))
        except InvalidInput as exc:
            raise bad_request(f"image {i} is not valid base64", "invalid_base64") from exc
    return blobs
