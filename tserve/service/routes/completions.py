"""OpenAI-compatible text generation: `/v1/completions` and `/v1/chat/completions`.

Each (prompt, choice) pair becomes one engine request; the engine batches them with everybody else's.
Streams of several choices are merged in arrival order, as OpenAI does (each chunk names its `index`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tserve.model.attention_maps import lm_attention_ids
from tserve.model.decoding import SamplingParams, parse_logit_bias
from tserve.model.decoding.structured import CompiledGrammar, Constraint, GrammarError
from tserve.model.tokenizer import Tokenizer, token_bytes
from tserve.service.connection import while_connected
from tserve.service.engine import Event, GenerationRequest, TokenLogprob
from tserve.service.errors import bad_request, engine_failure
from tserve.service.generation.tool_calls import ToolMode, ToolStream, parse_output, tool_mode
from tserve.service.routes.deps import (
    SSE_DONE,
    SSE_HEADERS,
    attention_selection,
    check_chars,
    check_count,
    check_max_tokens,
    log_inputs,
    new_id,
    now,
    served_model,
    settings,
    sse,
)
from tserve.service.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    NamedToolChoice,
    SamplingFields,
)
from tserve.service.tasks import ServedLanguageModel

router = APIRouter(tags=["text generation"])
ANY_OBJECT = '{"type": "object"}'  # response_format json_object

_ERRORS = {200: {"content": {"text/event-stream": {"description": "with stream true: SSE chunks, then [DONE]"}}},
           400: {"description": "invalid request"}, 404: {"description": "unknown model"},
           429: {"description": "queue full (Retry-After)"}, 503: {"description": "models loading"}}


@dataclass
class Choice:
    """The accumulated result of one engine request."""

    index: int
    request: GenerationRequest
    prefix: str = ""  # echoed prompt
    prefix_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prefix_offsets: list[int] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each generated token starts in prefix + text
    finish_reason: str | None = None

    def add(self, event: Event) -> list[int]:
        """Take one event; return the text offsets of its tokens."""
        own = event.text_start if event.text_start is not None else len(self.text)
        start = [len(self.prefix) + own] * len(event.logprobs)
        self.offsets.extend(start)
        self.text += event.text
        self.tokens += len(event.token_ids)
        self.token_ids += event.token_ids
        self.logprobs.extend(event.logprobs)
        self.finish_reason = event.finish_reason or self.finish_reason
        return start

    def logprobs_dict(self, tokenizer) -> dict[str, Any]:
        """The completions API's column format for the whole choice (echoed prompt first)."""
        items = self.prefix_logprobs + self.logprobs
        prompt_tokens = tokenizer.tokens(self.request.prompt_ids) if self.prefix_logprobs else []
        return _legacy_logprobs(items, prompt_tokens + [lp.token for lp in self.logprobs],
                                self.prefix_offsets + self.offsets)


# --------------------------------------------------------------------------------------------------
# Request -> engine requests
# --------------------------------------------------------------------------------------------------
def _logit_bias(body: SamplingFields, vocab_size: int) -> dict[int, float]:
    try:
        return parse_logit_bias(body.logit_bias, vocab_size)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_logit_bias") from exc


def _constraint(body: SamplingFields) -> Constraint | None:
    """What `response_format` (OpenAI) or `structured_outputs` (vLLM's extension) asks the output to match."""
    wanted, fmt = body.structured_outputs, body.response_format
    if wanted is not None and fmt is not None and fmt.type != "text":
        raise bad_request("give response_format or structured_outputs, not both", "invalid_response_format")
    if wanted is not None:
        if wanted.json_ is not None:
            return Constraint("json", wanted.json_ if isinstance(wanted.json_, str) else json.dumps(wanted.json_))
        if wanted.json_object:
            return Constraint("json", ANY_OBJECT)
        if wanted.regex is not None:
            return Constraint("regex", wanted.regex)
        if wanted.choice is not None:
            return Constraint("choice", json.dumps(wanted.choice))
        return Constraint("grammar", wanted.grammar)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json", ANY_OBJECT)
    schema = fmt.json_schema.schema_
    return Constraint("json", json.dumps(schema if schema is not None else {}))


async def _grammar(body: SamplingFields, served: ServedLanguageModel,
                   tools: ToolMode | None = None) -> CompiledGrammar | None:
    """The request's constraint (its response format's, or its tool choice's), compiled (cached by the model's
    compiler); a bad one is a 400 with the grammar library's message."""
    constraint = _constraint(body)
    if tools is not None and tools.constrained:
        if constraint is not None:
            raise bad_request("tool_choice required or a named function cannot be combined with a response "
                              "format", "invalid_response_format")
        constraint = tools.constraint
    if constraint is None:
        return None
    try:
        return await served.compile_grammar(constraint)
    except GrammarError as exc:
        raise bad_request(str(exc), "invalid_response_format") from exc


def _sampling(body: SamplingFields, max_tokens: int, seed_offset: int, logprobs: int | None,
              logit_bias: dict[int, float], grammar: CompiledGrammar | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min(body.min_tokens, max_tokens), temperature=body.temperature,
        top_p=body.top_p, top_k=max(body.top_k, 0), presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=logit_bias,
        # Choice j of a seeded request uses seed + j: reproducible, yet the n choices differ.
        seed=None if body.seed is None else (body.seed + seed_offset) % 2**63,
        stop=list(body.stop or []), ignore_eos=body.ignore_eos, logprobs=logprobs, grammar=grammar,
    )


def _encode(tokenizer: Tokenizer, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    check_chars(text, limit)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not text or not ids:
        raise bad_request("the prompt is empty", "empty_prompt")
    return ids


def _token_ids(ids: list[int], vocab_size: int) -> list[int]:
    """A prompt given as token ids, each one of the model's."""
    if bad := [i for i in ids if not 0 <= i < vocab_size]:
        raise bad_request(f"prompt token id {bad[0]} is not in the model's vocabulary (0 to {vocab_size - 1})",
                          "invalid_prompt")
    return list(ids)


async def _merged(served: ServedLanguageModel, choices: list[Choice]) -> AsyncIterator[tuple[Choice, Event]]:
    """Events of all choices as they come. Leaving early (client gone) cancels every request."""
    async with aclosing(served.events([c.request for c in choices])) as events:
        async for i, event in events:
            yield choices[i], event


async def _collect(request: Request, served: ServedLanguageModel, choices: list[Choice]) -> None:
    """Run every choice to completion; a client that disconnects cancels them."""

    async def consume() -> None:
        async with aclosing(_merged(served, choices)) as merged:
            async for choice, event in merged:
                choice.add(event)

    try:
        await while_connected(request, consume())
    except Exception as exc:
        raise engine_failure(exc, "generation") from exc


def _choice_chunk(base: dict[str, Any], c: Choice, choice: dict[str, Any], continuous: bool) -> str:
    """One choice's SSE chunk; with `continuous` (stream_options.continuous_usage_stats, vLLM's), that choice's
    usage so far."""
    if not continuous:
        return sse(base | {"choices": [choice]})
    prompt = len(c.request.prompt_ids)
    return sse(base | {"choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": c.tokens,
                                                      "total_tokens": prompt + c.tokens}})


def _continuous_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """Usage in every chunk: vLLM's `continuous_usage_stats`, which takes effect only with `include_usage`."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


async def _event_stream(served: ServedLanguageModel, choices: list[Choice], base: dict[str, Any],
                        render: Callable[[Choice, Event, list[int]], dict[str, Any] | list[dict[str, Any]]],
                        usage: Callable[[], dict[str, Any]] | None, continuous: bool = False) -> AsyncIterator[str]:
    """SSE chunks of the merged choices (rendered per API; with `continuous`, each with its choice's usage), an
    engine failure as an error event, the usage chunk when asked for, then [DONE]."""
    try:
        async with aclosing(_merged(served, choices)) as merged:
            async for c, event in merged:
                offsets = c.add(event)
                if not (event.text or event.logprobs or event.finish_reason):
                    continue  # the detokenizer is holding back an unfinished character
                rendered = render(c, event, offsets)
                for choice in rendered if isinstance(rendered, list) else [rendered]:
                    yield _choice_chunk(base, c, choice, continuous)
    except Exception as exc:
        err = engine_failure(exc, "generation")
        yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
    else:
        if usage is not None:
            yield sse(base | {"choices": [], "usage": usage()})
    yield SSE_DONE


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens read from the prefix cache (`prompt_tokens_details.cached_tokens`)."""
    completion_tokens = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.request.cached_tokens for c in choices)}}


def _streaming(chunks: AsyncIterator[str], choices: list[Choice]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:  # the client left before the end (even before the first event): free the slots
            for c in choices:
                c.request.cancel()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)


# --------------------------------------------------------------------------------------------------
# Logprob formats
# --------------------------------------------------------------------------------------------------
def _legacy_logprobs(items: list[TokenLogprob | None], tokens: list[str], offsets: list[int]) -> dict[str, Any]:
    return {"tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in items],
            "top_logprobs": [None if lp is None else lp.top for lp in items],
            "text_offset": offsets}


def _chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token_bytes(token))}

    return {"content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top.items()]}
                        for lp in items]}


# --------------------------------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------------------------------
@router.post("/v1/completions", responses=_ERRORS, response_model=CompletionResponse,
             response_model_exclude_unset=True)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    cfg = settings(request)
    served = served_model(request, body.model, ServedLanguageModel.task, body.priority)
    if body.suffix:
        raise bad_request("suffix is not supported: the model writes after the prompt only", "unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported: ask for n choices (with logprobs to rank them)",
                          "unsupported_parameter")
    given = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
    check_count("prompts", len(given), cfg.max_prompts)
    check_count("choices (n)", body.n, cfg.max_n)
    check_max_tokens(body.max_tokens or 16, cfg.max_tokens_limit)
    encoded = [_encode(served.tokenizer, p, cfg.max_input_chars) if isinstance(p, str)
               else _token_ids(p, served.vocab_size) for p in given]
    # A prompt given as ids is echoed (and logged) as its text.
    prompts = [p if isinstance(p, str) else served.tokenizer.decode(ids, skip_special_tokens=False)
               for p, ids in zip(given, encoded, strict=True)]
    log_inputs(request, prompts)
    bias = _logit_bias(body, served.vocab_size)
    grammar = await _grammar(body, served)
    jobs = [(ids, _sampling(body, body.max_tokens or 16, j, body.logprobs, bias, grammar)) for ids in encoded
            for j in range(body.n)]
    for ids, params in jobs[:: body.n]:
        try:
            served.check_limits(len(ids), params.max_tokens)
        except ValueError as exc:
            raise bad_request(str(exc), "context_length_exceeded") from exc
    max_prompt = max(len(ids) for ids in encoded)
    attention = attention_selection(served, body.return_attention, body.stream, len(jobs),
                                    body.max_tokens or 16, max_prompt + (body.max_tokens or 16),
                                    cfg.max_attention_floats)
    echo_logprobs: list[list[TokenLogprob | None]] = [[] for _ in prompts]
    if body.echo and body.logprobs is not None:
        echo_logprobs = [await served.call(request, "generation", "invalid_request", served.score_prompt, ids,
                                           body.logprobs) for ids in encoded]
    requests = served.submit(jobs)
    choices = []
    for i, req in enumerate(requests):
        p = i // body.n
        # Where each echoed token starts in the echo: a text prompt is echoed as written (its BOS is in no
        # character of it), a prompt of ids as their text, special tokens included.
        skip = isinstance(given[p], str)
        offsets = [len(served.tokenizer.decode(encoded[p][:k], skip_special_tokens=skip))
                   for k in range(len(echo_logprobs[p]))]
        choices.append(Choice(i, req, prompts[p] if body.echo else "", echo_logprobs[p], offsets))
    completion_id, created, model = new_id("cmpl"), now(), served.name
    prompt_tokens = sum(len(ids) for ids in encoded)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            base = {"id": completion_id, "object": "text_completion", "created": created, "model": model}
            for c in choices:
                if c.prefix:
                    lp = c.logprobs_dict(served.tokenizer) if body.logprobs is not None else None
                    yield _choice_chunk(base, c, {"text": c.prefix, "index": c.index, "logprobs": lp,
                                                  "finish_reason": None}, _continuous_usage(body))

            def render(c: Choice, event: Event, offsets: list[int]) -> dict[str, Any]:
                lp = None
                if body.logprobs is not None:
                    lp = _legacy_logprobs(event.logprobs, [x.token for x in event.logprobs], offsets)
                return {"text": event.text, "index": c.index, "logprobs": lp, "finish_reason": event.finish_reason}

            usage = (lambda: _usage(prompt_tokens * body.n, choices)) if include_usage else None
            async for chunk in _event_stream(served, choices, base, render, usage, _continuous_usage(body)):
                yield chunk

        return _streaming(chunks(), choices)

    await _collect(request, served, choices)
    out = []
    for c in choices:
        lp = c.logprobs_dict(served.tokenizer) if body.logprobs is not None else None
        out.append({"text": c.prefix + c.text, "index": c.index, "logprobs": lp, "finish_reason": c.finish_reason})
    if attention is not None:
        for item, c in zip(out, choices, strict=True):
            ids = c.request.prompt_ids + c.token_ids
            maps = await served.call(request, "attention", "invalid_attention_request", lm_attention_ids,
                                     served.loaded, ids, *attention, len(c.request.prompt_ids))
            item["attention"] = {"maps": [m.to_dict() for m in maps]}
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": _usage(prompt_tokens * body.n, choices)}


# --------------------------------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------------------------------
def _chat_message(tools: ToolMode, choice: Choice) -> dict[str, Any]:
    """The assistant's message: its text, or the tool calls it made (a constrained answer cut by max_tokens
    stays text, with finish_reason length)."""
    if tools.mode == "none" or (tools.constrained and choice.finish_reason != "stop"):
        return {"role": "assistant", "content": choice.text}
    try:
        content, calls = parse_output(tools, choice.text)
    except (ValueError, TypeError, KeyError):  # a stop string cut the call short: what came, as text
        return {"role": "assistant", "content": choice.text}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message

@router.post("/v1/chat/completions", responses=_ERRORS, response_model=ChatCompletionResponse,
             response_model_exclude_unset=True)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    cfg = settings(request)
    served = served_model(request, body.model, ServedLanguageModel.task, body.priority)
    if served.tokenizer.chat_template is None:
        raise bad_request(f"model {served.name!r} has no chat template; use /v1/completions", "no_chat_template")
    check_count("choices (n)", body.n, cfg.max_n)
    try:
        tools = tool_mode([t.model_dump() for t in body.tools or []], body.tool_choice if not isinstance(
            body.tool_choice, NamedToolChoice) else body.tool_choice.model_dump(), body.parallel_tool_calls)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_tool_choice") from exc
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message continues the last message: it needs add_generation_prompt false",
                          "invalid_messages")
    try:
        prompt = served.tokenizer.apply_chat_template(
            [m.for_template() for m in body.messages], add_generation_prompt=body.add_generation_prompt,
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            continue_final_message=body.continue_final_message)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_messages") from exc
    log_inputs(request, [prompt])
    ids = _encode(served.tokenizer, prompt, cfg.max_input_chars, add_special_tokens=False)
    requested = body.max_completion_tokens or body.max_tokens
    if requested is not None:
        check_max_tokens(requested, cfg.max_tokens_limit)
    max_tokens = requested or max(1, min(cfg.max_tokens_limit, served.max_len - len(ids)))
    top = (body.top_logprobs or 0) if body.logprobs else None
    bias = _logit_bias(body, served.vocab_size)
    grammar = await _grammar(body, served, tools)
    jobs = [(ids, _sampling(body, max_tokens, j, top, bias, grammar)) for j in range(body.n)]
    choices = [Choice(i, req) for i, req in enumerate(served.submit(jobs))]
    completion_id, created, model = new_id("chatcmpl"), now(), served.name

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            base = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
            for c in choices:
                yield _choice_chunk(base, c, {"index": c.index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}, _continuous_usage(body))

            streams = {c.index: ToolStream(tools) for c in choices}
            # With tools, a choice's text may be held back (a call still being parsed): its tokens' logprobs wait
            # with it and go out with its next chunk, so that every token's entry is streamed once, in order.
            unsent: dict[int, list[TokenLogprob]] = {c.index: [] for c in choices}

            def render(c: Choice, event: Event, _: list[int]) -> list[dict[str, Any]]:
                if tools.mode == "none":
                    lp = _chat_logprobs(event.logprobs) if body.logprobs else None
                    delta = {"content": event.text} if event.text or event.finish_reason is None else {}
                    return [{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": event.finish_reason}]
                deltas, finish = streams[c.index].deltas(event.text, event.finish_reason)
                out = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
                if finish is not None:
                    out.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish})
                if body.logprobs:
                    unsent[c.index] += event.logprobs
                    if out and unsent[c.index]:
                        out[0]["logprobs"], unsent[c.index] = _chat_logprobs(unsent[c.index]), []
                return out

            usage = (lambda: _usage(len(ids) * body.n, choices)) if include_usage else None
            async for chunk in _event_stream(served, choices, base, render, usage, _continuous_usage(body)):
                yield chunk

        return _streaming(chunks(), choices)

    await _collect(request, served, choices)
    out = [{"index": c.index, "message": _chat_message(tools, c),
            "logprobs": _chat_logprobs(c.logprobs) if body.logprobs else None, "finish_reason": c.finish_reason}
           for c in choices]
    for o in out:
        if o["message"].get("tool_calls"):
            o["finish_reason"] = "tool_calls"
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": _usage(len(ids) * body.n, choices)}
