"""`/v1/translations`: every input is a document whose sentences are requests of the translation engine
(continuous batching, beams included); one input can stream: a greedy sentence token by token, a document
(or beams) segment by segment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tserve.model.attention_maps import translation_attention_ids
from tserve.service.engine.translation_input import DocumentJob
from tserve.service.errors import bad_request, engine_failure
from tserve.service.routes.deps import (
    SSE_DONE,
    SSE_HEADERS,
    attention_selection,
    log_inputs,
    prioritise,
    ready_registry,
    served_model,
    settings,
    sse,
)
from tserve.service.schemas import TranslationRequest, TranslationResponse
from tserve.service.tasks import ServedTranslator
from tserve.service.translation.inputs import TranslationAsk
from tserve.service.translation.routing import pick_route, translate_route
from tserve.service.translation.served import TranslationOutput, TranslationRun, assemble

router = APIRouter(tags=["translation"])


def _usage(docs: list[DocumentJob], completion_tokens: int) -> dict[str, int]:
    prompt = sum(len(j.source_ids) for d in docs for j in d.jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _item(index: int, out: TranslationOutput, n: int) -> dict[str, Any]:
    item = {"index": index, "translation": out.text, "score": out.score}
    if n > 1:
        item["alternatives"] = [{"translation": text, "score": score} for text, score in out.alternatives]
    return item


@router.post("/v1/translations", response_model=TranslationResponse, response_model_exclude_none=True,
             responses={400: {"description": "invalid request"}, 404: {"description": "unknown model"},
                        429: {"description": "queue full (Retry-After)"}})
async def create_translation(body: TranslationRequest, request: Request) -> Any:
    cfg = settings(request)
    prioritise(body.priority)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    log_inputs(request, inputs)
    ask = TranslationAsk(inputs, body.num_beams, body.max_tokens, body.n, body.glossary, body.format == "html",
                         body.source_lang, body.target_lang, cache=body.cache)
    routed = None
    if body.model is None and served_translators(request) > 1:
        routed = await pick_route(ready_registry(request), inputs, body.source_lang, body.target_lang, ask.html)
        if len(routed) > 1:
            return await _pivoted(request, body, ask, routed)
        source, target = routed[0][1]
        ask = replace(ask, source_lang=body.source_lang or source, target_lang=body.target_lang or target)
    served = routed[0][0] if routed else served_model(request, body.model, ServedTranslator.task)
    docs = served.checked_documents(ask)
    if body.stream and len(docs) != 1:
        raise bad_request("streaming takes exactly one input", "stream_unsupported")
    if body.format == "html" and (body.stream or body.return_attention is not None):
        raise bad_request("format html answers whole pages: without stream and return_attention", "invalid_format")
    if body.return_alignment and body.stream:
        raise bad_request("return_alignment answers whole translations: without stream", "stream_unsupported")
    attention = None
    if body.return_attention is not None:
        if any(len(d.jobs) != 1 for d in docs):
            raise bad_request("return_attention takes inputs of one sentence each", "invalid_attention_request")
        jobs = [d.jobs[0] for d in docs]
        longest = max(len(j.source_ids) for j in jobs)
        steps = max(j.max_new_tokens for j in jobs) + 1
        attention = attention_selection(served, body.return_attention, body.stream, len(jobs), steps,
                                        steps + longest, cfg.max_attention_floats)
    if not body.stream:
        outputs = await served.translate(request, docs, body.n, body.return_alignment, body.cache)
        data = [_item(i, out, body.n) for i, out in enumerate(outputs)]
        if body.return_alignment:
            for item, out in zip(data, outputs, strict=True):
                item["segments"] = out.segments
        if attention is not None:
            for item, doc, out in zip(data, docs, outputs, strict=True):
                maps = await served.call(request, "attention", "invalid_attention_request",
                                         translation_attention_ids, served.loaded, doc.jobs[0].source_ids,
                                         out.token_ids, *attention)
                item["attention"] = {"maps": [m.to_dict() for m in maps if m.module != "encoder.self"]}
        answer = {"object": "translation", "model": served.name, "data": data,
                  "usage": _usage(docs, sum(len(out.token_ids) for out in outputs))}
        return answer | ({"models": [served.name]} if routed else {})
    doc = docs[0]
    run = await served.stream(docs, body.cache)
    base = {"object": "translation.chunk", "model": served.name}
    if len(doc.jobs) == 1 and doc.jobs[0].num_beams == 1 and body.n == 1:
        return StreamingResponse(_token_chunks(run, doc, base), media_type="text/event-stream", headers=SSE_HEADERS)
    return StreamingResponse(_segment_chunks(run, doc, base, body.n), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def served_translators(request: Request) -> int:
    return sum(isinstance(m, ServedTranslator) for m in ready_registry(request).models.values())


async def _pivoted(request: Request, body: TranslationRequest, ask: TranslationAsk, hops: tuple) -> dict[str, Any]:
    """A pair no served model has, through two that chain at --pivot-language (`translation_routing`)."""
    if body.stream or body.return_attention is not None or body.return_alignment:
        raise bad_request("a pivoted pair answers whole translations: without stream, return_attention and "
                          "return_alignment (or name one model)", "pivot_unsupported")
    result = await translate_route(request, hops, ask)
    prompt, completion = result.prompt_tokens, result.completion_tokens
    return {"object": "translation", "model": hops[-1][0].name, "models": [served.name for served, _ in hops],
            "data": [_item(i, out, body.n) for i, out in enumerate(result.outputs)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


async def _token_chunks(run: TranslationRun, doc: DocumentJob, base: dict[str, Any]) -> AsyncIterator[str]:
    """One greedy sentence: its text as it is decoded (the translation memory's in one chunk); the layout around
    it in the first and last chunks."""
    layout = doc.document.layout
    text, tokens, first = "", 0, True
    try:
        async with aclosing(run.events()) as events:
            async for event in events:
                tokens += len(event.token_ids)
                if not event.text and event.finish_reason is None:
                    continue  # a token without text of its own yet (special, or part of a character)
                delta = (layout[0] if first else "") + event.text + (layout[1] if event.finish_reason else "")
                text, first = text + delta, False
                item = {"index": 0, "translation": text, "delta": delta}
                chunk = base | {"data": [item]}
                if event.finish_reason is not None:
                    item["score"] = event.result[0].score
                    chunk |= {"finish_reason": event.finish_reason, "usage": _usage([doc], tokens)}
                yield sse(chunk)
    except Exception as exc:
        err = engine_failure(exc, "translation")
        yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
    yield SSE_DONE


async def _segment_chunks(run: TranslationRun, doc: DocumentJob, base: dict[str, Any], n: int) -> AsyncIterator[str]:
    """A document (or beams): each segment, once finished, in order; `delta` is the segment's translation
    with the layout before it (and, for the last, after it), so that the deltas add up to the translation."""
    layout = doc.document.layout
    text, done = "", []
    try:
        async with aclosing(run.in_order()) as segments:
            async for seg in segments:
                i = len(done)
                done.append(seg)
                delta = layout[i] + seg.text + (layout[-1] if i == len(doc.jobs) - 1 else "")
                text += delta
                item = {"index": 0, "segment": i, "translation": text, "delta": delta}
                chunk = base | {"data": [item]}
                if i == len(doc.jobs) - 1:
                    out = assemble(doc, done, n)
                    item |= _item(0, out, n) | {"delta": delta, "segment": i}
                    chunk |= {"finish_reason": out.finish_reason,
                              "usage": _usage([doc], sum(len(s.token_ids) for s in done))}
                yield sse(chunk)
    except Exception as exc:
        err = engine_failure(exc, "translation")
        yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
    yield SSE_DONE
