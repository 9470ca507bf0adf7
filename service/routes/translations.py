"""`/v1/translations`: whole inputs batched dynamically; one greedy input can stream its text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.engine import QueueFull
from service.errors import APIError, bad_request, overloaded
from service.routes.deps import SSE_DONE, SSE_HEADERS, check_count, served_model, settings, sse
from service.runners import InvalidInput, TranslationJob, TranslationResult
from service.schemas import TranslationRequest, TranslationResponse

router = APIRouter(tags=["translation"])


def _usage(results: list[TranslationResult]) -> dict[str, int]:
    prompt, completion = sum(r.prompt_tokens for r in results), sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@router.post("/v1/translations", response_model=TranslationResponse,
             responses={400: {"description": "invalid request"}, 404: {"description": "unknown model"},
                        429: {"description": "queue full (Retry-After)"}})
async def create_translation(body: TranslationRequest, request: Request) -> Any:
    cfg = settings(request)
    served = served_model(request, body.model, "translation")
    inputs = [body.input] if isinstance(body.input, str) else body.input
    check_count("inputs", len(inputs), cfg.max_prompts)
    jobs: list[TranslationJob] = []
    for i, text in enumerate(inputs):
        if not text.strip():
            raise bad_request(f"input {i} is empty", "empty_input")
        if len(text) > cfg.max_input_chars:
            raise bad_request(f"input {i} has {len(text)} characters; the limit is {cfg.max_input_chars}",
                              "input_too_long")
        try:
            jobs.append(served.translator.job(text, body.num_beams, body.max_tokens))
        except InvalidInput as exc:
            raise bad_request(f"input {i}: {exc}", "input_too_long") from exc
    if body.stream and (len(jobs) != 1 or jobs[0].num_beams != 1):
        raise bad_request("streaming takes exactly one input and greedy decoding (num_beams 1)", "stream_unsupported")

    pieces: asyncio.Queue[str] = asyncio.Queue()
    if body.stream:
        loop = asyncio.get_running_loop()
        jobs[0].on_text = lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece)
    try:
        pending = served.batcher.enqueue(jobs)
    except QueueFull as exc:
        raise overloaded(str(exc)) from exc

    if not body.stream:
        try:
            results = await asyncio.gather(*(served.batcher.result(p) for p in pending))
        except RuntimeError as exc:
            raise APIError(500, str(exc), "server_error", "translation_failed") from exc
        data = [{"index": i, "translation": r.text} for i, r in enumerate(results)]
        return {"object": "translation", "model": served.name, "data": data, "usage": _usage(results)}

    async def chunks() -> AsyncIterator[str]:
        base = {"object": "translation.chunk", "model": served.name}
        result_task = asyncio.ensure_future(served.batcher.result(pending[0]))
        text = ""
        try:
            while True:
                getter = asyncio.ensure_future(pieces.get())
                await asyncio.wait({getter, result_task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                text += getter.result()
                yield sse(base | {"data": [{"index": 0, "translation": text, "delta": getter.result()}]})
            result = await result_task
        except RuntimeError as exc:
            yield sse({"error": {"message": str(exc), "type": "server_error", "code": "translation_failed"}})
        else:
            while not pieces.empty():  # text pushed just before the batch returned
                text += pieces.get_nowait()
            tail = result.text[len(text):] if result.text.startswith(text) else ""
            yield sse(base | {"data": [{"index": 0, "translation": result.text, "delta": tail}],
                              "finish_reason": "stop", "usage": _usage([result])})
        finally:
            result_task.cancel()
        yield SSE_DONE

    return StreamingResponse(chunks(), media_type="text/event-stream", headers=SSE_HEADERS)
