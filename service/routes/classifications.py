"""`/v1/classifications`: images as base64 in JSON or as multipart uploads, batched dynamically."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from service.errors import APIError, bad_request
from service.routes.deps import check_count, served_model, settings
from service.runners import InvalidInput
from service.schemas import ClassificationRequest, ClassificationResponse
from service.tasks import ServedClassifier
from service.tasks.image_classification import decode_base64

router = APIRouter(tags=["image classification"])

_MULTIPART_SCHEMA = {
    "type": "object",
    "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"}, "description": "one or more images"},
        "model": {"type": "string"},
        "top_k": {"type": "integer", "default": 5, "minimum": 1},
    },
    "required": ["file"],
}
_OPENAPI = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": ClassificationRequest.model_json_schema()},
    "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
}}}


def _decode_b64(value: str, index: int) -> bytes:
    try:
        return decode_base64(value)
    except InvalidInput as exc:
        raise bad_request(f"image {index} is not valid base64", "invalid_base64") from exc


def _validated(data: dict[str, Any]) -> ClassificationRequest:
    try:
        return ClassificationRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from exc


async def _parse(request: Request, max_images: int) -> tuple[ClassificationRequest, list[bytes]]:
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=max_images + 1, max_fields=16)
        except Exception as exc:  # malformed multipart bodies
            if isinstance(exc, APIError):
                raise
            raise bad_request(f"malformed multipart body: {exc}", "invalid_multipart") from exc
        files = [f for f in form.getlist("file") if isinstance(f, UploadFile)]
        fields = {k: v for k, v in form.items() if k in ("model", "top_k") and isinstance(v, str)}
        body = _validated(fields)
        if not files:
            raise bad_request("multipart requests need at least one 'file' part", "missing_image")
        check_count("images", len(files), max_images)
        return body, [await f.read() for f in files]
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON ({exc})", "invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", "invalid_json")
    body = _validated(data)
    images = ([body.image] if body.image is not None else []) + list(body.images or [])
    if not images:
        raise bad_request("give an image: 'image' (base64) or 'images' (list of base64)", "missing_image")
    check_count("images", len(images), max_images)
    return body, [_decode_b64(v, i) for i, v in enumerate(images)]


@router.post("/v1/classifications", response_model=ClassificationResponse, openapi_extra=_OPENAPI,
             responses={400: {"description": "invalid request or image"}, 404: {"description": "unknown model"},
                        429: {"description": "queue full (Retry-After)"}})
async def create_classification(request: Request) -> Any:
    cfg = settings(request)
    body, blobs = await _parse(request, cfg.max_prompts)
    served = served_model(request, body.model, ServedClassifier.task)
    pixels = []
    for i, blob in enumerate(blobs):
        try:
            # Decoding and resizing are CPU work: off the event loop.
            pixels.append(await asyncio.to_thread(served.classifier.preprocess, blob))
        except InvalidInput as exc:
            raise bad_request(f"image {i}: {exc}", "invalid_image") from exc
    results = await served.classify(request, pixels)
    top_k = min(body.top_k, len(served.loaded.labels))
    data = [{"index": i, "predictions": [{"label": label, "score": score} for label, score in ranked[:top_k]]}
            for i, ranked in enumerate(results)]
    return {"object": "classification", "model": served.name, "data": data}
