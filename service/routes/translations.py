"""`/v1/translations`: every input is a request of the translation engine (continuous batching, beams
included); one greedy input can stream its text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from model.attention_maps import translation_attention_ids
from service.connection import run_job
from service.engine import QueueFull, TranslationEngine
from service.engine import TranslationRequest as EngineRequest
from service.errors import bad_request, engine_failure
from service.routes.deps import (
    SSE_DONE,
    SSE_HEADERS,
    attention_selection,
    check_count,
    check_max_tokens,
    log_inputs,
    served_model,
    settings,
    sse,
)
from service.runners import InvalidInput, TranslationJob
from service.schemas import TranslationRequest, TranslationResponse
from service.tasks import ServedTranslator

router = APIRouter(tags=["translation"])


def _usage(jobs: list[TranslationJob], completion_tokens: int) -> dict[str, int]:
    prompt = sum(len(j.source_ids) for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


@router.post("/v1/translations", response_model=TranslationResponse, response_model_exclude_none=True,
             responses={400: {"description": "invalid request"}, 404: {"description": "unknown model"},
                        429: {"description": "queue full (Retry-After)"}})
async def create_translation(body: TranslationRequest, request: Request) -> Any:
    cfg = settings(request)
    served = served_model(request, body.model, ServedTranslator.task)
    engine: TranslationEngine = served.engine
    inputs = [body.input] if isinstance(body.input, str) else body.input
    check_count("inputs", len(inputs), cfg.max_prompts)
    if body.max_tokens is not None:
        check_max_tokens(body.max_tokens, cfg.max_tokens_limit)
    log_inputs(request, inputs)
    try:
        jobs = served.jobs(inputs, body.num_beams, body.max_tokens)
    except InvalidInput as exc:
        raise bad_request(str(exc), exc.code) from exc
    if body.stream and (len(jobs) != 1 or jobs[0].num_beams != 1):
        raise bad_request("streaming takes exactly one input and greedy decoding (num_beams 1)", "stream_unsupported")
    longest = max(len(j.source_ids) for j in jobs)
    steps = max(j.max_new_tokens for j in jobs) + 1
    attention = attention_selection(served, body.return_attention, body.stream, len(jobs), steps,
                                    steps + longest, cfg.max_attention_floats)
    if not body.stream:
        results = await served.translate(request, jobs)
        data = [{"index": i, "translation": text} for i, (text, _) in enumerate(results)]
        if attention is not None:
            for item, job, (_, ids) in zip(data, jobs, results, strict=True):
                maps = await run_job(request, engine, "attention", "invalid_attention_request",
                                     translation_attention_ids, served.loaded, job.source_ids, ids, *attention)
                item["attention"] = {"maps": [m.to_dict() for m in maps if m.module != "encoder.self"]}
        return {"object": "translation", "model": served.name, "data": data,
                "usage": _usage(jobs, sum(len(ids) for _, ids in results))}

    try:
        submitted: list[EngineRequest] = engine.submit_all(jobs)
    except (QueueFull, ValueError) as exc:
        raise engine_failure(exc, "translation") from exc

    async def chunks() -> AsyncIterator[str]:
        base = {"object": "translation.chunk", "model": served.name}
        text, tokens = "", 0
        try:
            async for event in engine.stream(submitted[0]):
                text += event.text
                tokens += len(event.token_ids)
                if not event.text and event.finish_reason is None:
                    continue  # a token without text of its own yet (special, or part of a character)
                chunk = base | {"data": [{"index": 0, "translation": text, "delta": event.text}]}
                if event.finish_reason is not None:
                    chunk |= {"finish_reason": event.finish_reason, "usage": _usage(jobs, tokens)}
                yield sse(chunk)
        except Exception as exc:
            err = engine_failure(exc, "translation")
            yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
        finally:
            submitted[0].cancel()
        yield SSE_DONE

    return StreamingResponse(chunks(), media_type="text/event-stream", headers=SSE_HEADERS)
