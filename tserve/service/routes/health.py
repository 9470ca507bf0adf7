"""Liveness, readiness, metrics and the model list."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tserve.service.errors import error_response
from tserve.service.routes.deps import registry
from tserve.service.schemas import ModelCard, ModelList

router = APIRouter()


@router.get("/healthz", tags=["health"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", tags=["health"], responses={503: {"description": "models loading or failed, or shutting down"}})
async def readyz(request: Request) -> Response:
    reg = registry(request)
    if reg.ready:
        return JSONResponse({"status": "ready", "models": sorted(reg.models)})
    if reg.draining:
        return error_response(503, "the server is shutting down", "server_error", "not_ready", {"Retry-After": "5"})
    if reg.error:
        return error_response(503, f"models failed to load: {reg.error}", "server_error", "not_ready")
    return error_response(503, "models are loading", "server_error", "not_ready", {"Retry-After": "5"})


@router.get("/metrics", tags=["health"], response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", tags=["models"], response_model=ModelList, response_model_exclude_none=True)
async def list_models(request: Request) -> ModelList:
    cards = [ModelCard(id=m.name, created=m.created, task=m.task, **m.card_fields())
             for m in registry(request).models.values()]
    return ModelList(data=cards)
