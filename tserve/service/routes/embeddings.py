"""`/v1/embeddings` (OpenAI's shape): text for language models and translators, images (base64 in JSON or
multipart `file` parts) for image models; every input becomes an item of the model's embedding batcher."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from tserve.model.embeddings import embedding_size
from tserve.service.errors import InvalidInput, bad_request
from tserve.service.routes.deps import (
    base64_images,
    check_chars,
    check_count,
    image_body,
    prioritise,
    ready_registry,
    settings,
)
from tserve.service.schemas import EmbeddingRequest, EmbeddingResponse
from tserve.service.tasks import ServedModel

router = APIRouter(tags=["embeddings"])

_OPENAPI = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": EmbeddingRequest.model_json_schema()},
    "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"}},
        "model": {"type": "string"}, "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1},
        "priority": {"type": "integer", "minimum": -1000, "maximum": 1000}}}},
}}}


async def _parse(request: Request, max_inputs: int) -> tuple[EmbeddingRequest, list[bytes]]:
    """The request and its images' bytes (none for text)."""
    body, uploads = await image_body(request, EmbeddingRequest, ("model", "encoding_format", "dimensions", "priority"),
                                     max_inputs)
    if uploads is not None:
        return body, uploads
    images = ([body.image] if body.image is not None else []) + list(body.images or [])
    if images and body.input is not None:
        raise bad_request("give 'input' (text) or images, not both", "invalid_input")
    return body, base64_images(images, max_inputs)


def _model(request: Request, name: str | None, kind: str) -> ServedModel:
    """The model asked for, which must embed `kind`; without a name, the only model that does."""
    registry = ready_registry(request)
    if name is not None:
        served = registry.get(name, None)
        if served.embeds != kind:
            what = f"embeds {served.embeds}" if served.embeds else "has no embeddings"
            raise bad_request(f"model {name!r} ({served.task}) {what}; this request gives {kind}", "wrong_task")
        return served
    candidates = [m for m in registry.models.values() if m.embeds == kind]
    if len(candidates) != 1:
        names = ", ".join(m.name for m in candidates) or "none"
        raise bad_request(f"say which model with 'model' ({kind} embedding models served: {names})",
                          "model_required")
    return candidates[0]


def _encode(vector: list[float] | Any, encoding: str) -> list[float] | str:
    values = np.asarray(vector, dtype="<f4")
    return base64.b64encode(values.tobytes()).decode() if encoding == "base64" else values.tolist()


@router.post("/v1/embeddings", response_model=EmbeddingResponse, openapi_extra=_OPENAPI,
             responses={400: {"description": "invalid request or input"}, 404: {"description": "unknown model"},
                        429: {"description": "queue full (Retry-After)"}})
async def create_embeddings(request: Request) -> Any:
    cfg = settings(request)
    body, blobs = await _parse(request, cfg.max_prompts)
    prioritise(body.priority)
    if blobs:
        served = _model(request, body.model, "image")
        items = []
        for i, blob in enumerate(blobs):
            try:  # decoding and resizing are CPU work: off the event loop
                items.append(await asyncio.to_thread(served.classifier.preprocess, blob))
            except InvalidInput as exc:
                raise bad_request(f"image {i}: {exc}", "invalid_image") from exc
        cfg = served.loaded.config
        tokens = len(items) * (cfg.n_patches + cfg.n_prefix_tokens)  # the patches, the class (DeiT: distillation) token
    else:
        if body.input is None:
            raise bad_request("give 'input' (text) or, for an image model, 'image' / 'images' / 'file'",
                              "missing_input")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts:
            raise bad_request("input list is empty", "missing_input")
        check_count("inputs", len(texts), cfg.max_prompts)
        for i, text in enumerate(texts):
            check_chars(text, cfg.max_input_chars, f"input {i}")
        served = _model(request, body.model, "text")
        items = []
        for i, text in enumerate(texts):
            try:
                items.append(served.embedding_ids(text, body.source_lang))
            except ValueError as exc:
                raise bad_request(f"input {i}: {exc}", "invalid_input") from exc
        tokens = sum(len(ids) for ids in items)
    size = embedding_size(served.loaded)
    if body.dimensions is not None and body.dimensions != size:
        # OpenAI's `dimensions` shortens the vectors of a model trained for it (Matryoshka); cut from any other
        # model's they lose what they mean, so such a request is refused (before any is computed), as vLLM does.
        raise bad_request(f"dimensions: model {served.name!r} gives embeddings of {size} values and cannot "
                          "shorten them", "unsupported_dimensions")
    vectors = await served.embed(request, items)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
