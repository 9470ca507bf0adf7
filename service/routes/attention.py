"""`/v1/attention`: attention maps of any served model, as JSON, in BertViz's shapes, or as a PNG."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from model import attention_maps as am
from service.attention_png import heatmap_grid, image_overlay
from service.engine import QueueFull
from service.errors import bad_request, engine_failure
from service.registry import ServedModel
from service.routes.classifications import _decode_b64
from service.routes.deps import (
    registry,
    served_model,
    settings,
    while_connected,
)
from service.routes.translations import collect_translation
from service.runners import InvalidInput, open_image
from service.schemas import AttentionRequest

router = APIRouter(tags=["attention"])

_MAX_PANELS = 64


def _model(request: Request, body: AttentionRequest) -> ServedModel:
    models = registry(request).models
    if body.model is not None:
        task = models[body.model].task if body.model in models else "text-generation"  # unknown: 404 below
    elif body.image is not None:
        task = "image-classification"
    elif body.target is not None:
        task = "translation"
    else:
        raise bad_request("say which model with 'model'", "model_required")
    return served_model(request, body.model, task)


async def _own_translation(request: Request, served: ServedModel, text: str) -> tuple[str, list[int]]:
    """What `/v1/translations` answers for `text` with the checkpoint's defaults: the same engine job."""
    engine = served.engine
    try:
        (req,) = engine.submit_all([engine.translator.job(text, None, None)])
    except InvalidInput as exc:
        raise bad_request(str(exc), "invalid_attention_request") from exc
    except (QueueFull, ValueError) as exc:
        raise engine_failure(exc, "translation") from exc
    try:
        return await while_connected(request, collect_translation(engine, req))
    except Exception as exc:
        raise engine_failure(exc, "translation") from exc
    finally:
        req.cancel()


def _compute(served: ServedModel, body: AttentionRequest, max_bytes: int, max_pixels: int,
             target_ids: list[int] | None) -> tuple[list, Any, str]:
    """(maps, decoded image or None, translation target or '') in a worker thread; ValueError -> 400.
    `target_ids`: the model's own translation, when no target was given."""
    loaded, image, target = served.loaded, None, ""
    if served.task == "image-classification":
        if body.image is None:
            raise ValueError("this model reads images: give 'image' (base64)")
        image = open_image(_decode_b64(body.image, 0), max_bytes, max_pixels)
        maps = am.vit_attention(loaded, loaded.preprocessing(image), body.layers, body.heads)
    else:
        if not body.input or not body.input.strip():
            raise ValueError("give the text to look at in 'input'")
        if served.task == "translation" and target_ids is not None:
            src = loaded.tokenizer.encode(body.input)
            maps = am.translation_attention_ids(loaded, src, target_ids, body.layers, body.heads)
            target = loaded.tokenizer.decode([t for t in target_ids if t != loaded.config.eos_token_id])
        elif served.task == "translation":
            maps, target = am.translation_attention(loaded, body.input, body.target, body.layers, body.heads)
        else:
            maps = am.lm_attention(loaded, body.input, body.layers, body.heads)
    return maps, image, target


@router.post("/v1/attention", responses={200: {"content": {"image/png": {}}},
                                         400: {"description": "invalid request or selection"},
                                         404: {"description": "unknown model"}})
async def attention(body: AttentionRequest, request: Request) -> Any:
    cfg = settings(request)
    served = _model(request, body)
    target_ids = None
    if served.task == "translation" and body.target is None and body.input and body.input.strip():
        try:
            am.check_selection(served.loaded, body.layers, body.heads)  # before the translation runs
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_attention_request") from exc
        target_ids = (await _own_translation(request, served, body.input))[1]
    try:
        maps, image, target = await asyncio.to_thread(_compute, served, body, cfg.max_image_bytes,
                                                      cfg.max_image_pixels, target_ids)
    except (ValueError, InvalidInput) as exc:
        raise bad_request(str(exc), "invalid_attention_request") from exc
    floats = sum(m.weights.numel() for m in maps)
    if floats > cfg.max_attention_floats:
        raise bad_request(f"this selection has {floats} attention weights; the limit is {cfg.max_attention_floats}: "
                          "ask for fewer 'layers' or 'heads', or a shorter input", "too_many_weights")
    heads = am.check_selection(served.loaded, body.layers, body.heads)[1]
    if body.format == "bertviz":
        return {"model": served.name, **am.to_bertviz(maps, served.task)}
    if body.format == "png":
        if image is not None:
            cls = am.attention_rollout(maps)[0, 1:] if body.rollout else maps[-1].weights.mean(0)[0, 1:]
            title = "rollout" if body.rollout else f"layer {maps[-1].layer}, heads averaged"
            png = image_overlay(image, cls, served.loaded.config.grid_size, f"[CLS] attention, {title}")
        else:
            if len(maps) * len(heads) > _MAX_PANELS:
                raise bad_request(f"{len(maps) * len(heads)} heatmaps asked for; a picture holds at most "
                                  f"{_MAX_PANELS}: select 'layers' and 'heads'", "too_many_panels")
            png = heatmap_grid(maps, heads)
        return Response(png, media_type="image/png")
    out: dict[str, Any] = {"model": served.name, "maps": [m.to_dict() for m in maps]}
    if served.task == "translation":
        out["target"] = target
    return out
