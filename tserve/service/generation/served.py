"""Text generation (causal LMs): the continuous-batching engine; attention maps of a text; completions over
the Open Inference Protocol. The main HTTP API is OpenAI's (`service.routes.completions`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from tserve.model import attention_maps as am
from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import SamplingParams, Speculation
from tserve.model.decoding.structured import CompiledGrammar, Constraint
from tserve.model.embeddings import embed_token_lists
from tserve.model.tokenizer import Tokenizer
from tserve.service.connection import while_connected
from tserve.service.engine import Event, GenerationEngine, GenerationRequest, TokenLogprob
from tserve.service.engine.worker import QueueFull
from tserve.service.errors import InvalidInput, OIPError, engine_failure
from tserve.service.limits import check_max_tokens
from tserve.service.schemas import AttentionRequest
from tserve.service.served import AttentionResult, ServedModel, bytes_elements
from tserve.service.settings import Settings

# OIP parameters of a completion: (type, lowest, highest); OpenAI's defaults (max_tokens 16, temperature 1).
# top_k: 0 or -1 is no top-k filter, as /v1 (and vLLM) take it.
_OIP_PARAMETERS = {"max_tokens": (int, 1, None), "temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0),
                   "top_k": (int, -1, None), "seed": (int, 0, 2**63 - 1), "ignore_eos": (bool, None, None)}


def speculation(s: Settings) -> Speculation | None:
    """--speculative (or --draft-model) and its settings as the runner takes them (None: off)."""
    if s.speculative == "off" and not s.draft_model:
        return None
    return Speculation(num_tokens=s.num_speculative_tokens, max_ngram=s.prompt_lookup_max,
                       min_ngram=min(s.prompt_lookup_min, s.prompt_lookup_max), max_rows=s.speculative_max_rows)


class ServedLanguageModel(ServedModel):
    embeds = "text"
    task = "text-generation"
    has_logit_lens = True
    drafts = True

    def __init__(self, *args: Any, draft: LoadedModel | None = None, **kwargs: Any) -> None:
        self.draft = draft  # --draft-model, loaded beside this model
        super().__init__(*args, **kwargs)

    def build_worker(self) -> GenerationEngine:
        s = self.settings
        self.engine = GenerationEngine(self.name, self.loaded, max_slots=s.max_running_requests,
                                       max_queue=s.max_queue, max_model_len=s.max_model_len,
                                       timeout_s=s.request_timeout_s, metrics=self.metrics,
                                       cuda_graphs=s.cuda_graphs, compile=s.compile,
                                       async_scheduling=s.async_scheduling,
                                       max_grammar_compile_ms=s.max_grammar_compile_ms,
                                       kv_cache_budget=s.kv_cache_budget, kv_block_size=s.kv_block_size,
                                       prefix_caching=s.prefix_cache, speculation=speculation(s), draft=self.draft)
        self.build_embedder(lambda ids: list(embed_token_lists(self.loaded, ids).cpu()))
        self.engine.reserved_rows = min(s.reserved_rows, s.max_running_requests - 1)
        return self.engine

    def warm_up(self) -> None:
        self.engine.warm_up()

    def card_fields(self) -> dict[str, Any]:
        return {"max_model_len": self.engine.max_len,
                "kv_cache_bytes_per_token": self.engine.runner.cache.bytes_per_token()}

    # ----------------------------------------------------------------------------------------------
    # A request's way through the engine: checked, submitted, its events streamed, cancelled at the end
    # ----------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_len(self) -> int:
        """The served context: prompt + completion tokens."""
        return self.engine.max_len

    @property
    def vocab_size(self) -> int:
        return self.engine.runner.vocab_size

    def check_limits(self, prompt_len: int, max_tokens: int) -> None:
        """A prompt and its max_tokens against the served context (ValueError, the client's)."""
        self.engine.check_limits(prompt_len, max_tokens)

    def score_prompt(self, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability and the top k (echo with logprobs); run it as a call job."""
        return self.engine.score_prompt(prompt_ids, k)

    async def compile_grammar(self, constraint: Constraint) -> CompiledGrammar:
        """A constraint as this model's token masks (cached per model), compiled off the event loop."""
        return await asyncio.to_thread(self.engine.runner.grammars.compile, constraint)

    def submit(self, jobs: list[tuple[list[int], SamplingParams]]) -> list[GenerationRequest]:
        """Queue every (prompt ids, sampling) pair as one client request; a full queue or a context that cannot
        hold it raises the HTTP error."""
        try:
            return self.engine.submit_all(jobs)
        except (QueueFull, ValueError) as exc:
            raise engine_failure(exc, "generation", "context_length_exceeded") from exc

    async def events(self, reqs: list[GenerationRequest]) -> AsyncIterator[tuple[int, Event]]:
        """(index into `reqs`, event) of every submitted request as the events come; an engine failure is
        raised here. Every request is cancelled when the stream ends, early or not (close it at once with
        `contextlib.aclosing`)."""
        if len(reqs) == 1:  # one stream (n = 1, the usual request): read here, not through a task and a queue
            try:
                async with aclosing(self.engine.stream(reqs[0], coalesce=True)) as stream:
                    async for event in stream:
                        yield 0, event
            finally:
                reqs[0].cancel()
            return
        queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, req: GenerationRequest) -> None:
            try:
                async for event in self.engine.stream(req, coalesce=True):
                    queue.put_nowait((i, event))
            except Exception as exc:  # surfaces in the consumer
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(reqs)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for r in reqs:
                r.cancel()

    def attention_maps(self, body: AttentionRequest, context: Any) -> AttentionResult:
        ids = self.text_ids(body.input)
        self.bound_weights(body, len(ids))
        return AttentionResult(am.lm_attention_ids(self.loaded, ids, body.layers, body.heads))

    def lens_inputs(self, body: Any, own_translation: list[int] | None) -> tuple[list[int], list[int] | None]:
        return self.text_ids(body.input), None

    # ----------------------------------------------------------------------------------------------
    # Open Inference Protocol: text in, text out (the tensor names of Triton's LLM backends)
    # ----------------------------------------------------------------------------------------------
    def oip_metadata(self) -> dict[str, Any]:
        return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}],
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]},
                            {"name": "finish_reason", "datatype": "BYTES", "shape": [-1]}]}

    async def oip_infer(self, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
        """Each prompt's continuation, as `/v1/completions` gives it. Parameters (request or tensor):
        max_tokens, temperature, top_p, top_k, seed, ignore_eos. Outputs: `text_output` and `finish_reason`
        ("stop" or "length"), one per prompt."""
        texts = bytes_elements(tensor, self.settings.max_prompts)
        params = _oip_sampling(tensor.get("parameters") or {}, self.settings.max_tokens_limit)
        limit = self.settings.max_input_chars
        jobs = []
        for text in texts:
            ids = self.loaded.tokenizer.encode(text) if text and len(text) <= limit else []
            if not ids:
                raise OIPError(400, f"every text_input must be a prompt of 1 to {limit} characters")
            jobs.append((ids, params))
        reqs = self.submit(jobs)
        texts, finishes = [""] * len(reqs), ["length"] * len(reqs)

        async def collect() -> None:
            async with aclosing(self.events(reqs)) as events:
                async for i, event in events:
                    texts[i] += event.text
                    finishes[i] = event.finish_reason or finishes[i]

        try:
            await while_connected(request, collect())
        except Exception as exc:
            raise engine_failure(exc, "generation") from exc
        return [{"name": "text_output", "datatype": "BYTES", "shape": [len(texts)], "data": texts},
                {"name": "finish_reason", "datatype": "BYTES", "shape": [len(texts)], "data": finishes}]


def _oip_sampling(parameters: dict[str, Any], max_tokens_limit: int) -> SamplingParams:
    values = {}
    for name, value in parameters.items():
        if name not in _OIP_PARAMETERS:
            raise OIPError(400, f"unknown parameter {name!r}; expected some of {sorted(_OIP_PARAMETERS)}")
        kind, low, high = _OIP_PARAMETERS[name]
        high = max_tokens_limit if name == "max_tokens" else high
        fits = isinstance(value, bool) if kind is bool else \
            isinstance(value, int | float if kind is float else int) and not isinstance(value, bool)
        if not fits or (low is not None and value < low) or (high is not None and value > high):
            what = "true or false" if kind is bool else \
                f"{'an integer' if kind is int else 'a number'} from {low}" + (f" to {high}" if high is not None else " up")
            raise OIPError(400, f"parameter {name} must be {what}, got {value!r}")
        values[name] = max(value, 0) if name == "top_k" else value
    params = SamplingParams(**values)
    if "max_tokens" not in values:  # the default counts against the limit, as on /v1/completions
        try:
            check_max_tokens(params.max_tokens, max_tokens_limit)
        except InvalidInput as exc:
            raise OIPError(400, str(exc)) from exc
    return params
