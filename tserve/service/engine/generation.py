"""Continuous batching for a causal language model: a cache row and the KV blocks it fills per request (its
cached prefix shared with others), every running request advances by one token per step, each chosen with its own parameters and generator, so a request's output
does not depend on its neighbours. The `DecoderRunner` does the model work and the next-token rules; this
engine schedules requests onto it and hands each token to the output stage (`output.py`).

Asynchronous scheduling (`async_scheduling`, on by default on CUDA): a step is launched before the tokens of the
step before are read. Its rows are fed those tokens on the device (`ChosenTokens`), and while the device
computes, the host reads the earlier step's tokens and does the per-request work (finish rules, detokenizing,
stop strings, streaming). A request that an eos or a stop string ends is computed once more and that row's
token dropped; one that max_tokens or the context ends is known on the host and not stepped again. Rows whose
next choice reads their tokens (penalties, a grammar), speculative steps and preemption read every token
first, so the output is the same token for token. Off (the CPU's default: nothing runs beside the host
there), every step's tokens are read before the next is planned: the same code, in the other order.

Admission counts blocks: a request is admitted when a row and the blocks of its uncached tokens are free. When
the pool runs dry mid-decode, the newest running requests are preempted: their blocks go back, they return
to the head of the queue, and when admitted again they recompute what they had from their tokens and go on
with the same generator, so they finish with the tokens they would have had."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from tserve.model.checkpoint import LoadedModel
from tserve.model.decoding import (
    DecoderRunner,
    SamplingParams,
    Speculation,
    StopStrings,
    TextSequence,
    generate,
    token_logprobs,
)
from tserve.model.decoding.lm_runner import StepLogprobs, speculation_of
from tserve.model.detokenizer import IncrementalDetokenizer
from tserve.service.engine.kv_memory import lm_kv_blocks
from tserve.service.engine.output import text_event, token_logprob
from tserve.service.engine.request import EngineRequest, Event, TokenLogprob
from tserve.service.engine.worker import Worker, overlaps
from tserve.service.metrics import Metrics

log = logging.getLogger("tserve.engine")

DEFAULT_MAX_MODEL_LEN = 4096  # without --max-model-len: the model's context, at most this


@contextlib.contextmanager
def _draws_undone_on_failure(reqs: list[GenerationRequest]) -> Iterator[None]:
    """A batch's choice that may be made again row by row: when it fails, each seeded request's generator is put
    back where it stood before it, so that its row chosen again alone draws what it draws beside no one (it may
    have drawn already in the failed call). A batch of one is not chosen again: nothing is kept for it."""
    kept = [(r.generator, r.generator.get_state()) for r in reqs
            if r.params.seed is not None and r.generator is not None] if len(reqs) > 1 else []
    try:
        yield
    except Exception:
        for generator, state in kept:
            generator.set_state(state)
        raise


class GenerationRequest(EngineRequest, TextSequence):
    """A sequence of the runner with a stream: its text is detokenized and checked for stop strings."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, deadline: float,
                 detokenizer: IncrementalDetokenizer, device: torch.device | str = "cpu") -> None:
        EngineRequest.__init__(self, deadline)
        TextSequence.__init__(self, prompt_ids, params, device)
        self.detok = detokenizer
        self.input_tokens = len(prompt_ids)
        self.stops = StopStrings(params.stop, unchecked=params.min_tokens)
        self.prefix_counted = False  # its admission is in the prefix cache's metrics

    def render(self, event: Event) -> Event:
        """Text for an event whose request has no stop strings: detokenized here, on the event loop, while the
        engine's thread goes on with the next step (the text cannot change how the request ends)."""
        if event.text_pending is None:
            return event
        token, is_eos = event.text_pending
        return text_event(self.detok, self.stops, token, is_eos, event.finish_reason,
                          event.logprobs[0] if event.logprobs else None)

    def join(self, first: Event, then: Event) -> Event | None:
        """Tokens' text and ids joined; not with logprobs (each token's entry keeps the text offset it starts at),
        an error or a result."""
        if first.logprobs or then.logprobs or then.error is not None or first.result is not None \
                or then.result is not None:
            return None
        return Event(first.text + then.text, first.token_ids + then.token_ids, finish_reason=then.finish_reason)


class GenerationEngine(Worker):
    def __init__(self, name: str, loaded: LoadedModel, *, max_slots: int, max_queue: int,
                 max_model_len: int | None, timeout_s: float, metrics: Metrics, cuda_graphs: bool = True,
                 compile: bool = False, max_grammar_compile_ms: float = 2000.0, kv_cache_budget: tuple[int | None, float | None] = (None, None),
                 kv_block_size: int = 16, prefix_caching: bool = True, speculation: Speculation | None = None,
                 draft: LoadedModel | None = None, async_scheduling: str = "auto") -> None:
        super().__init__(name, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, capacity=max_slots)
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        context = max_model_len or min(loaded.config.max_seq_len, DEFAULT_MAX_MODEL_LEN)
        context = min(context, loaded.config.max_seq_len)
        speculates = speculation_of(speculation, draft)
        ahead = speculates.num_tokens if speculates is not None else 0
        num_blocks, window_blocks = lm_kv_blocks(loaded, kv_cache_budget, kv_block_size, max_slots, context, ahead)
        self.runner = DecoderRunner(loaded, num_slots=max_slots, max_len=context, cuda_graphs=cuda_graphs,
                                    compile=compile, max_grammar_compile_ms=max_grammar_compile_ms,
                                    num_blocks=num_blocks, block_size=kv_block_size, prefix_caching=prefix_caching,
                                    speculation=speculation, draft=draft, window_blocks=window_blocks)
        self._drafted = self._accepted = 0  # since start, for the acceptance-rate gauge
        self.max_len, self.device = self.runner.max_len, loaded.device
        self.prefix_caching = prefix_caching
        self.overlap = overlaps(async_scheduling, self.device)
        self.m.kv_bytes_per_token.set(self.runner.cache.bytes_per_token())
        self.m.kv_bytes.set(self.runner.cache.nbytes())
        self.m.kv_blocks_total.set(self.runner.blocks.num_usable)
        self.m.kv_block_size.set(kv_block_size)

    # ----------------------------------------------------------------------------------------------
    # Event-loop side
    # ----------------------------------------------------------------------------------------------
    def check_limits(self, prompt_len: int, max_tokens: int) -> None:
        self.runner.check(prompt_len, max_tokens)

    def submit(self, prompt_ids: list[int], params: SamplingParams, **part: Any) -> GenerationRequest:
        """Queue a request (raises QueueFull or ValueError). Must be called on the event loop."""
        self.check_limits(len(prompt_ids), params.max_tokens)
        req = GenerationRequest(prompt_ids, params, time.perf_counter() + self.timeout_s,
                                IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids), self.device)
        self._enqueue(req, **part)
        return req

    def submit_job(self, job: tuple[list[int], SamplingParams], **part: Any) -> GenerationRequest:
        return self.submit(*job, **part)

    @property
    def slots_in_use(self) -> int:
        return self.runner.slots.num_used

    def warm_up(self) -> None:
        """One short prompt through this engine's runner (before `start`), so that the first real request
        does not pay for lazy initialisation."""
        generate(self.loaded, [self.tokenizer.encode("Hello") or [0]], SamplingParams(max_tokens=2, temperature=0.0),
                 runner=self.runner)

    @torch.inference_mode()
    def score_prompt(self, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Log-probabilities of each prompt token given the ones before it (for `echo` with `logprobs`).
        The first token has none. A forward pass without the cache, run as a call job of this engine."""
        tokens = torch.tensor([prompt_ids], device=self.device)
        logits = self.model(tokens)[0, :-1].float()
        chosen, top_v, top_i = (t.tolist() for t in token_logprobs(logits, tokens[0, 1:], k))
        out: list[TokenLogprob | None] = [None]
        for tok, c, tv, ti in zip(prompt_ids[1:], chosen, top_v, top_i, strict=True):
            top = dict(zip(self.tokenizer.tokens(ti), tv, strict=True))
            out.append(TokenLogprob(self.tokenizer.tokens([tok])[0], c, top))
        return out

    # ----------------------------------------------------------------------------------------------
    # Worker thread
    # ----------------------------------------------------------------------------------------------
    @property
    def rows_in_use(self) -> int:
        return self.runner.slots.num_used

    def _reserve(self, req: GenerationRequest) -> bool:
        if not self.runner.admit(req):
            return False
        if self.prefix_caching and not req.prefix_counted:  # the client's request, once: a preempted one coming
            req.prefix_counted = True                          # back finds its own blocks, no client's cache hit
            (self.m.prefix_hits if req.table.num_cached_tokens else self.m.prefix_misses).inc()
            self.m.prefix_cached_tokens.inc(req.table.num_cached_tokens)
        return True

    def _release(self, req: GenerationRequest) -> None:
        self.runner.release(req)

    def _make_room(self, reqs: list[GenerationRequest],
                   drafts: dict[int, list[int]]) -> list[GenerationRequest] | None:
        """A block for every running request's next position, oldest first; when none is free, the newest
        request holding blocks is preempted (it may be the one asking). Then blocks for the drafts (`drafts` by
        id) from what is left: a draft that does not fit is dropped, never a reason to preempt. Returns the
        requests that keep running; None when a preemption is due while tokens are on their way (the caller
        reads them and asks again: a preempted request resumes from every token it has)."""
        asking = set(reqs)
        order = [r for r in self.running if r in asking]  # admission order
        for req in order:
            while req.table is not None and not self.runner.grow(req):
                if self._in_flight:
                    return None
                victim = next(r for r in reversed(order) if r.table is not None)
                self._preempt(victim)
        running = [r for r in order if r.table is not None]
        for req in running:
            if drafts.get(id(req)) and not self.runner.grow(req, len(drafts[id(req)])):
                drafts[id(req)] = []
        return running

    def _preempt(self, req: GenerationRequest) -> None:
        """Free its row and blocks and put it back at the head of the queue; it resumes from its tokens."""
        self.runner.release(req)
        self._requeue_preempted(req, len(req.token_ids()))

    def _update_gauges(self) -> None:
        super()._update_gauges()
        self.m.kv_blocks_in_use.set(self.runner.blocks.num_in_use)

    def _prefill(self, reqs: list[GenerationRequest]) -> None:
        self._isolated(reqs, self._prefill_forward, self._choose)

    def _decode(self) -> None:
        if not self.overlap or self.runner.speculation is not None or any(
                self.runner.needs_tokens(r) for r in self.running):
            self._read_tokens()
        while True:
            reqs = [r for r in self.running if r.has_next and not self.runner.ends_by_length(r)]
            drafts = {id(r): d for r, d in zip(reqs, self.runner.drafts(reqs), strict=True)}
            planned = self._make_room(reqs, drafts)
            if planned is not None:
                break
            self._read_tokens()
        reqs = planned
        if not reqs:
            return
        if not any(drafts[id(r)] for r in reqs):
            self._isolated(reqs, self._decode_forward, self._choose)
            return

        def forward(rows: list[GenerationRequest]) -> torch.Tensor:
            self.m.batch_size.observe(len(rows))
            return self.runner.decode_ahead(rows, [drafts[id(r)] for r in rows])

        self._isolated(reqs, forward, lambda rows, logits: self._emit_ahead(rows, [drafts[id(r)] for r in rows],
                                                                              logits))

    def _prefill_forward(self, reqs: list[GenerationRequest]) -> torch.Tensor:
        self.m.batch_size.observe(len(reqs))
        return self.runner.prefill(reqs)

    def _decode_forward(self, reqs: list[GenerationRequest]) -> torch.Tensor:
        self.m.batch_size.observe(len(reqs))
        return self.runner.decode(reqs)

    def _choose(self, reqs: list[GenerationRequest], logits: torch.Tensor) -> None:
        """The step's tokens, on their way to their requests. Its forward pass has written its positions and
        counted them (run again, it would feed each token one position further on), so a choice that fails for
        the batch (a row's logits not a distribution) is made again row by row from the same logits, into which a
        choice writes nothing but bans, and only a row whose own choice fails fails."""
        try:
            with _draws_undone_on_failure(reqs):
                chosen = self.runner.choose_later(reqs, logits)
        except Exception:
            if len(reqs) == 1:
                raise  # (`_isolated` fails it)
            log.warning("a batch's choice failed; choosing for its requests one by one",
                        extra={"model": self.name, "size": len(reqs)})
            for i, req in enumerate(reqs):
                try:
                    chosen = self.runner.choose_later([req], logits[i : i + 1])
                except Exception as exc:  # noqa: BLE001 - the request's own failure, reported to it
                    self._fail(req, exc)
                    continue
                self._launched([req], chosen)
            return
        self._launched(reqs, chosen)

    def _take(self, reqs: list[GenerationRequest], tokens: list[int], logprobs: StepLogprobs | None) -> None:
        now = time.perf_counter()
        row = {id(r): i for i, r in enumerate(reqs)}
        self._each(reqs, lambda req: self._emit(req, tokens[row[id(req)]],
                                                self._logprob(req, row[id(req)], tokens, logprobs), now))

    def _emit_ahead(self, reqs: list[GenerationRequest], drafts: list[list[int]], logits: torch.Tensor) -> None:
        """A speculative step: each request's kept draft and the model's next token, one event each."""
        with _draws_undone_on_failure(reqs):  # a failure here runs each row's step again alone (`_isolated`)
            tokens, logprobs, where = self.runner.choose_ahead(reqs, drafts, logits)
        now = time.perf_counter()
        row = {id(r): i for i, r in enumerate(reqs)}
        emitted: dict[int, int] = {}  # row -> the tokens of this step its request took

        def emit(req: GenerationRequest) -> None:
            i = row[id(req)]
            emitted[i] = 0
            for token, at in zip(tokens[i], where[i], strict=True):
                if req.finished:  # eos, max_tokens or a stop string among its kept tokens
                    return
                lp = None if logprobs is None or req.params.logprobs is None else \
                    token_logprob(self.tokenizer, req.params.logprobs, token, at, logprobs)
                self._emit(req, token, lp, now)
                emitted[i] += 1

        self._each(reqs, emit)
        # Kept drafts the requests took: those after an eos or a stop string among them are not output
        drafted = sum(map(len, drafts))
        kept = sum(min(n, len(tokens[i]) - 1) for i, n in emitted.items())
        self._drafted, self._accepted = self._drafted + drafted, self._accepted + kept
        self.m.spec_drafted.inc(drafted)
        self.m.spec_accepted.inc(kept)
        self.m.spec_acceptance.set(self._accepted / max(self._drafted, 1))
        for n in emitted.values():
            self.m.spec_tokens_per_step.observe(n)

    def _logprob(self, req: GenerationRequest, i: int, tokens: list[int],
                 logprobs: StepLogprobs | None) -> TokenLogprob | None:
        if logprobs is None or req.params.logprobs is None:
            return None
        return token_logprob(self.tokenizer, req.params.logprobs, tokens[i], i, logprobs)

    def _emit(self, req: GenerationRequest, token: int, lp: TokenLogprob | None, now: float) -> None:
        """The runner's finish rule, then the output stage (text, stop strings, the event)."""
        before = len(req.generated)
        finish = self.runner.append(req, token)
        is_eos = len(req.generated) == before  # an eos that ends the sequence is not part of the output
        if req.stops.stops:  # the text decides whether it stops: rendered now
            event = text_event(req.detok, req.stops, token, is_eos, finish, lp)
        else:
            event = Event("", [] if is_eos else [token], [lp] if lp is not None and not is_eos else [], finish,
                          text_pending=(token, is_eos))
        if event.finish_reason == "stop":
            req.finish_reason = "stop"  # eos, or a stop string: the runner decodes it no further
        self._step_tokens += 1
        self._publish(req, event, now)
