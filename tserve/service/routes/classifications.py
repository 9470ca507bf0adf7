"""`/v1/classifications`: images as base64 in JSON or as multipart uploads, batched dynamically."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from tserve.service.errors import InvalidInput, bad_request
from tserve.service.routes.deps import base64_images, image_body, served_model, settings
from tserve.service.schemas import ClassificationRequest, ClassificationResponse
from tserve.service.tasks import ServedClassifier

router = APIRouter(tags=["image classification"])

_MULTIPART_SCHEMA = {
    "type": "object",
    "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"}, "description": "one or more images"},
        "model": {"type": "string"},
        "top_k": {"type": "integer", "default": 5, "minimum": 1},
        "priority": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["file"],
}
_OPENAPI = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": ClassificationRequest.model_json_schema()},
    "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
}}}


async def _parse(request: Request, max_images: int) -> tuple[ClassificationRequest, list[bytes]]:
    body, uploads = await image_body(request, ClassificationRequest, ("model", "top_k", "priority"), max_images)
    if uploads is not None:
        return body, uploads
    images = ([body.image] if body.image is not None else []) + list(body.images or [])
    if not images:
        raise bad_request("give an image: 'image' (base64) or 'images' (list of base64)", "missing_image")
    return body, base64_images(images, max_images)


@router.post("/v1/classifications", response_model=ClassificationResponse, openapi_extra=_OPENAPI,
             responses={400: {"description": "invalid request or image"}, 404: {"description": "unknown model"},
                        429: {"description": "queue full (Retry-After)"}})
async def create_classification(request: Request) -> Any:
    cfg = settings(request)
    body, blobs = await _parse(request, cfg.max_prompts)
    served = served_model(request, body.model, ServedClassifier.task, body.priority)
    pixels = []
    for i, blob in enumerate(blobs):
        try:
            # Decoding and resizing are CPU work: off the event loop.
            pixels.append(await asyncio.to_thread(served.classifier.preprocess, blob))
        except InvalidInput as exc:
            raise bad_request(f"image {i}: {exc}", "invalid_image") from exc
    results = await served.classify(request, pixels)
    top_k = min(body.top_k, len(served.loaded.labels))
    data = [{"index": i, "predictions": [{"label": p.label, "score": p.score} for p in ranked[:top_k]]}
            for i, ranked in enumerate(results)]
    return {"object": "classification", "model": served.name, "data": data}
