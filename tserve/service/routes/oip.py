"""The Open Inference Protocol (KServe / Triton "v2" REST) beside our own API, for every model whose task
describes its tensors (`ServedModel.oip_metadata`): the classifier (BYTES images, base64, or FP32 pixels
[N, C, H, W]), the translator and the language model (BYTES text in and out). Errors are `{"error": "..."}`, as the protocol
says."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tserve.service.errors import OIPError
from tserve.service.routes.deps import registry
from tserve.service.schemas import (
    OIPInferenceRequest,
    OIPInferenceResponse,
    OIPModelMetadata,
    inline_json_schema,
)
from tserve.service.tasks import ServedModel

router = APIRouter(prefix="/v2", tags=["open inference protocol"])


def _model(request: Request, name: str) -> ServedModel:
    models = registry(request).models
    served = models.get(name)
    if served is None or served.oip_metadata() is None:
        raise OIPError(404, f"model {name!r} is not served over this protocol; models: "
                            f"{sorted(n for n, m in models.items() if m.oip_metadata() is not None)}")
    return served


def _metadata(served: ServedModel) -> dict[str, Any]:
    return {"name": served.name, "versions": ["1"], "platform": "tserve-pytorch", **served.oip_metadata()}


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
    """The input tensor, with the request's parameters under the tensor's own."""
    tensor = body.inputs[0]
    if tensor.name not in names:
        raise OIPError(400, f"unknown input {tensor.name!r}; expected one of {list(names)}")
    return tensor.model_dump() | {"parameters": (body.parameters or {}) | (tensor.parameters or {})}


def _parse(raw: bytes) -> OIPInferenceRequest:
    try:
        return OIPInferenceRequest.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        raise OIPError(400, f"invalid inference request: {problems}") from exc


@router.post("/models/{name}/infer", response_model=OIPInferenceResponse, response_model_exclude_none=True,
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": inline_json_schema(OIPInferenceRequest)}}}})
async def infer(name: str, request: Request) -> dict[str, Any]:
    """Validated after the model is found, so that an unknown model is a 404 whatever the body."""
    if not registry(request).ready:
        raise OIPError(503, "models are still loading")
    served = _model(request, name)
    body = _parse(await request.body())
    names = tuple(t["name"] for t in served.oip_metadata()["inputs"])
    outputs = await served.oip_infer(_tensor(body, names), request)
    if body.outputs:
        names = {o.name for o in body.outputs}
        outputs = [o for o in outputs if o["name"] in names]
    return {"model_name": served.name, "model_version": "1", "id": body.id, "outputs": outputs}
