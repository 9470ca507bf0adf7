"""The Open Inference Protocol (KServe / Triton "v2" REST) beside our own API, for the classifier
(BYTES images, base64, or FP32 pixels [N, C, H, W]) and the translator (BYTES text in and out).
Errors are `{"error": "..."}`, as the protocol says."""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from service.engine import QueueFull
from service.errors import APIError, engine_failure
from service.registry import ServedModel
from service.routes.deps import registry, while_connected
from service.runners import InvalidInput
from service.schemas import OIPInferenceRequest, OIPInferenceResponse, OIPModelMetadata, inline_json_schema

router = APIRouter(prefix="/v2", tags=["open inference protocol"])

_TASKS = ("image-classification", "translation")


class OIPError(APIError):
    """A request the protocol refuses; rendered as `{"error": message}` like every error under /v2/."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, "invalid_request_error" if status < 500 else "server_error")


def _model(request: Request, name: str) -> ServedModel:
    served = registry(request).models.get(name)
    if served is None or served.task not in _TASKS:
        raise OIPError(404, f"model {name!r} is not served over this protocol; models: "
                            f"{sorted(n for n, m in registry(request).models.items() if m.task in _TASKS)}")
    return served


def _metadata(served: ServedModel) -> dict[str, Any]:
    if served.task == "translation":
        inputs = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        outputs = [{"name": "translation", "datatype": "BYTES", "shape": [-1]}]
    else:
        cfg = served.loaded.config
        inputs = [{"name": "image", "datatype": "BYTES", "shape": [-1]},
                  {"name": "pixels", "datatype": "FP32", "shape": [-1, cfg.n_channels, cfg.image_size, cfg.image_size]}]
        outputs = [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                   {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(served.loaded.labels)]}]
    return {"name": served.name, "versions": ["1"], "platform": "tserve-pytorch", "inputs": inputs,
            "outputs": outputs}


@router.get("/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    ok = registry(request).ready
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get("/models/{name}/ready")
async def model_ready(name: str, request: Request) -> JSONResponse:
    served = _model(request, name)
    ok = registry(request).ready
    return JSONResponse({"name": served.name, "ready": ok}, status_code=200 if ok else 503)


@router.get("/models/{name}", response_model=OIPModelMetadata)
async def model_metadata(name: str, request: Request) -> dict[str, Any]:
    return _metadata(_model(request, name))


def _tensor(body: OIPInferenceRequest, names: tuple[str, ...]) -> dict[str, Any]:
    tensor = body.inputs[0]
    if tensor.name not in names:
        raise OIPError(400, f"unknown input {tensor.name!r}; expected one of {list(names)}")
    return tensor.model_dump()


def _parse(raw: bytes) -> OIPInferenceRequest:
    try:
        return OIPInferenceRequest.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        raise OIPError(400, f"invalid inference request: {problems}") from exc


def _strings(tensor: dict[str, Any], limit: int) -> list[str]:
    if tensor.get("datatype") != "BYTES" or len(tensor["shape"]) != 1:
        raise OIPError(400, f"input {tensor['name']!r} must be BYTES with shape [N]")
    if not tensor["data"] or len(tensor["data"]) > limit:
        raise OIPError(400, f"give 1 to {limit} elements")
    if not all(isinstance(x, str) for x in tensor["data"]):
        raise OIPError(400, "BYTES elements must be strings")
    return tensor["data"]


async def _classify(served: ServedModel, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
    cfg, limits = served.loaded.config, request.app.state.settings
    classifier = served.classifier
    if tensor["name"] == "image":
        pixels = []
        for i, item in enumerate(_strings(tensor, limits.max_prompts)):
            try:
                blob = base64.b64decode(item, validate=True)
                pixels.append(await asyncio.to_thread(classifier.preprocess, blob))
            except (binascii.Error, ValueError, InvalidInput) as exc:
                raise OIPError(400, f"image {i}: {exc}") from exc
    else:
        want = [cfg.n_channels, cfg.image_size, cfg.image_size]
        if tensor.get("datatype") != "FP32" or len(tensor["shape"]) != 4 or tensor["shape"][1:] != want:
            raise OIPError(400, f"'pixels' must be FP32 with shape [N, {', '.join(map(str, want))}]")
        if not 1 <= tensor["shape"][0] <= limits.max_prompts:
            raise OIPError(400, f"give 1 to {limits.max_prompts} images")
        try:
            batch = torch.tensor(tensor["data"], dtype=torch.float32).reshape(tensor["shape"])
        except (TypeError, ValueError) as exc:
            raise OIPError(400, "'pixels' data must be numbers") from exc
        if not torch.isfinite(batch).all():
            raise OIPError(400, "'pixels' must be finite")
        pixels = list(batch)
    try:
        pending = served.batcher.enqueue(pixels)
        results = await while_connected(request, asyncio.gather(*(served.batcher.result(p) for p in pending)))
    except Exception as exc:
        raise engine_failure(exc, "classification") from exc
    request.app.state.metrics.images.labels(served.name).inc(len(results))
    index = {label: i for i, label in enumerate(served.loaded.labels)}
    probs = [[0.0] * len(index) for _ in results]
    for row, ranked in zip(probs, results, strict=True):
        for label, score in ranked:
            row[index[label]] = score
    n = len(results)
    return [{"name": "label", "datatype": "BYTES", "shape": [n], "data": [r[0][0] for r in results]},
            {"name": "probabilities", "datatype": "FP32", "shape": [n, len(index)],
             "data": [p for row in probs for p in row]}]


async def _translate(served: ServedModel, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
    engine, limits = served.engine, request.app.state.settings
    texts = _strings(tensor, limits.max_prompts)
    try:
        jobs = [engine.translator.job(t, None, None) for t in texts]
    except InvalidInput as exc:
        raise OIPError(400, str(exc)) from exc
    try:
        requests = engine.submit_all(jobs)
    except (QueueFull, ValueError) as exc:
        raise engine_failure(exc, "translation") from exc

    async def text_of(req) -> str:
        return "".join([event.text async for event in engine.stream(req)])

    try:
        out = await while_connected(request, asyncio.gather(*(text_of(r) for r in requests)))
    except Exception as exc:
        raise engine_failure(exc, "translation") from exc
    finally:
        for r in requests:
            r.cancel()
    return [{"name": "translation", "datatype": "BYTES", "shape": [len(out)], "data": list(out)}]


@router.post("/models/{name}/infer", response_model=OIPInferenceResponse, response_model_exclude_none=True,
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": inline_json_schema(OIPInferenceRequest)}}}})
async def infer(name: str, request: Request) -> dict[str, Any]:
    """Validated after the model is found, so that an unknown model is a 404 whatever the body."""
    if not registry(request).ready:
        raise OIPError(503, "models are still loading")
    served = _model(request, name)
    body = _parse(await request.body())
    if served.task == "translation":
        outputs = await _translate(served, _tensor(body, ("text",)), request)
    else:
        outputs = await _classify(served, _tensor(body, ("image", "pixels")), request)
    if body.outputs:
        names = {o.name for o in body.outputs}
        outputs = [o for o in outputs if o["name"] in names]
    return {"model_name": served.name, "model_version": "1", "id": body.id, "outputs": outputs}
