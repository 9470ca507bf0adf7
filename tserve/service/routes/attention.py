"""`/v1/attention`: attention maps of any served model, as JSON, in BertViz's shapes, or as a PNG. The maps
are model work of the model's worker (a call job: queue limits, deadline, its thread); the task says how."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tserve.model import attention_maps as am
from tserve.service.errors import bad_request
from tserve.service.routes.deps import ready_registry, served_model
from tserve.service.schemas import AttentionRequest, AttentionResponse, BertVizResponse
from tserve.service.tasks import ServedModel
from tserve.service.vision.attention_png import heatmap_grid, image_overlay

router = APIRouter(tags=["attention"])

_MAX_PANELS = 64


def _model(request: Request, body: AttentionRequest) -> ServedModel:
    """The model named, or the only one that reads what the body gives ('image' or 'target')."""
    if body.model is not None:
        return served_model(request, body.model, None)
    models = ready_registry(request).models.values()
    if body.image is not None:
        candidates = [m for m in models if m.reads_images]
    elif body.target is not None:
        candidates = [m for m in models if m.scores_targets]
    else:
        candidates = []
    if len(candidates) != 1:
        raise bad_request("say which model with 'model'", "model_required")
    return served_model(request, candidates[0].name, None)


@router.post("/v1/attention", response_model=AttentionResponse | BertVizResponse, response_model_exclude_unset=True,
             responses={200: {"content": {"image/png": {}}}, 400: {"description": "invalid request or selection"},
                        404: {"description": "unknown model"}, 429: {"description": "queue full (Retry-After)"}})
async def attention(body: AttentionRequest, request: Request) -> Any:
    served = _model(request, body)
    try:
        layers, heads = am.check_selection(served.loaded, body.layers, body.heads)  # before any work
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_attention_request") from exc
    panels = len(heads) * sum(i < n for i in layers for n in am.layer_counts(served.loaded).values())
    if body.format == "png" and not served.reads_images and panels > _MAX_PANELS:
        raise bad_request(f"{panels} heatmaps asked for; a picture holds at most {_MAX_PANELS}: select 'layers' "
                          "and 'heads'", "too_many_panels")
    context = await served.attention_context(request, body)
    result = await served.call(request, "attention", "invalid_attention_request", served.attention_maps,
                               body, context)
    maps = result.maps
    if body.format == "bertviz":
        return {"model": served.name, **am.to_bertviz(maps)}
    if body.format == "png":
        if result.image is not None:
            patches = served.loaded.config.n_prefix_tokens  # where the patches start
            deepest = max(maps, key=lambda m: m.layer)  # whatever the order the layers were named in
            cls = am.attention_rollout(maps)[0, patches:] if body.rollout else deepest.weights.mean(0)[0, patches:]
            title = "rollout" if body.rollout else f"layer {deepest.layer}, heads averaged"
            png = image_overlay(result.image, cls, served.loaded.config.grid_size, f"[CLS] attention, {title}")
        else:
            png = heatmap_grid(maps, heads)
        return Response(png, media_type="image/png")
    return {"model": served.name, "maps": [m.to_dict() for m in maps], **result.extra}
