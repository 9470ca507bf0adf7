"""`/v1/attention`: attention maps of any served model, as JSON, in BertViz's shapes, or as a PNG."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from model import attention_maps as am
from service.attention_png import heatmap_grid, image_overlay
from service.engine import QueueFull
from service.errors import bad_request, engine_failure
from service.registry import ServedModel
from service.routes.classifications import _decode_b64
from service.routes.deps import registry, run_job, served_model, settings, while_connected
from service.routes.translations import collect_translation
from service.runners import InvalidInput, open_image
from service.schemas import AttentionRequest
from service.settings import Settings

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


def _bounded(loaded, body: AttentionRequest, limit: int, n_tokens: int = 0, n_target: int = 0) -> None:  # noqa: ANN001
    """--max-attention-floats, checked from the token counts before the model runs."""
    floats = am.weight_count(loaded, body.layers, body.heads, n_tokens, n_target)
    if floats > limit:
        raise InvalidInput(f"this selection has {floats} attention weights; the limit is {limit}: ask for fewer "
                           "'layers' or 'heads', or a shorter input", "too_many_weights")


def _compute(served: ServedModel, body: AttentionRequest, cfg: Settings,
             target_ids: list[int] | None) -> tuple[list, Any, str]:
    """(maps, decoded image or None, translation target or ''): a call job in the model's worker; a
    ValueError is the client's (400). `target_ids`: the model's own translation, when no target was given."""
    loaded, tok, image, target = served.loaded, served.loaded.tokenizer, None, ""
    if served.task == "image-classification":
        if body.image is None:
            raise ValueError("this model reads images: give 'image' (base64)")
        image = open_image(_decode_b64(body.image, 0), cfg.max_image_bytes, cfg.max_image_pixels)
        _bounded(loaded, body, cfg.max_attention_floats)
        return am.vit_attention(loaded, loaded.preprocessing(image), body.layers, body.heads), image, target
    if not body.input or not body.input.strip():
        raise ValueError("give the text to look at in 'input'")
    if served.task == "translation":
        src = tok.encode(body.input)
        if len(src) > loaded.config.max_source_len:
            raise ValueError(f"the input has {len(src)} tokens; this model takes at most "
                             f"{loaded.config.max_source_len}")
        if target_ids is None:
            target, target_ids = body.target, tok.encode_target(body.target)
        eos = loaded.config.eos_token_id
        target_ids = [t for t in target_ids if t != eos]
        target = target or tok.decode(target_ids)
        _bounded(loaded, body, cfg.max_attention_floats, len(src), len(target_ids))
        return am.translation_attention_ids(loaded, src, target_ids, body.layers, body.heads), image, target
    ids = tok.encode(body.input)
    if not ids:
        raise ValueError("the input is empty after tokenization")
    if len(ids) > loaded.config.max_seq_len:
        raise ValueError(f"the input has {len(ids)} tokens; this model takes at most {loaded.config.max_seq_len}")
    _bounded(loaded, body, cfg.max_attention_floats, len(ids))
    return am.lm_attention_ids(loaded, ids, body.layers, body.heads), image, target


@router.post("/v1/attention", responses={200: {"content": {"image/png": {}}},
                                         400: {"description": "invalid request or selection"},
                                         404: {"description": "unknown model"},
                                         429: {"description": "queue full (Retry-After)"}})
async def attention(body: AttentionRequest, request: Request) -> Any:
    cfg = settings(request)
    served = _model(request, body)
    try:
        layers, heads = am.check_selection(served.loaded, body.layers, body.heads)  # before any work
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_attention_request") from exc
    panels = len(heads) * sum(i < n for i in layers for n in am.layer_counts(served.loaded).values())
    if body.format == "png" and body.image is None and panels > _MAX_PANELS:
        raise bad_request(f"{panels} heatmaps asked for; a picture holds at most {_MAX_PANELS}: select 'layers' "
                          "and 'heads'", "too_many_panels")
    target_ids = None
    if served.task == "translation" and body.target is None and body.input and body.input.strip():
        target_ids = (await _own_translation(request, served, body.input))[1]
    maps, image, target = await run_job(request, served.worker, "attention", "invalid_attention_request",
                                        _compute, served, body, cfg, target_ids)
    if body.format == "bertviz":
        return {"model": served.name, **am.to_bertviz(maps)}
    if body.format == "png":
        if image is not None:
            cls = am.attention_rollout(maps)[0, 1:] if body.rollout else maps[-1].weights.mean(0)[0, 1:]
            title = "rollout" if body.rollout else f"layer {maps[-1].layer}, heads averaged"
            png = image_overlay(image, cls, served.loaded.config.grid_size, f"[CLS] attention, {title}")
        else:
            png = heatmap_grid(maps, heads)
        return Response(png, media_type="image/png")
    out: dict[str, Any] = {"model": served.name, "maps": [m.to_dict() for m in maps]}
    if served.task == "translation":
        out["target"] = target
    return out
