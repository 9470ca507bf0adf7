"""Continuous-batching generation engine for a causal language model (no HTTP in here).

A worker thread runs the step loop so that the event loop stays free:
    1. retire cancelled and timed-out requests (their KV slots are free for this very step),
    2. admit waiting requests into free slots and prefill them as one padded batch,
    3. run one batched decode step for every running request,
    4. sample each row with its own parameters and generator, push text to each request's stream,
    5. retire finished requests.
Requests join and leave between steps; a request's greedy output does not depend on its neighbours.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from model.checkpoint import LoadedModel
from model.generation import SamplingParams, StopStrings, apply_penalties, sample, token_logprobs
from model.kv_cache import SlotAllocator
from model.tokenizer import IncrementalDetokenizer
from service.metrics import Metrics

log = logging.getLogger("tserve.engine")


class QueueFull(Exception):
    """The waiting queue is at capacity (HTTP 429)."""


class RequestTimeout(Exception):
    """A request ran past its deadline."""


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: dict[str, float]


@dataclass
class Event:
    """What a request's stream receives after a step."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    error: BaseException | None = None


class GenerationRequest:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
                 deadline: float, detokenizer: IncrementalDetokenizer) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.deadline = deadline
        self.cancelled = False
        self.finished = False
        # Engine-side state.
        self.slot = -1
        self.generated: list[int] = []
        self.next_token: int | None = None  # sampled, not yet fed to the model
        self.generator = None if params.greedy else params.make_generator()
        self.counts: torch.Tensor | None = None
        self.detok = detokenizer
        self.stops = StopStrings(params.stop)
        self.last_emit = 0.0

    def cancel(self) -> None:
        """Called from the event loop when the client goes away; the engine frees the slot next step."""
        self.cancelled = True

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop that submitted it has closed: nobody is listening any more
            self.cancelled = True


class GenerationEngine:
    def __init__(self, name: str, loaded: LoadedModel, *, max_slots: int, max_queue: int,
                 max_model_len: int | None, timeout_s: float, metrics: Metrics) -> None:
        self.name, self.loaded, self.model = name, loaded, loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_len = min(max_model_len or loaded.config.max_seq_len, loaded.config.max_seq_len)
        self.max_queue, self.timeout_s, self.metrics = max_queue, timeout_s, metrics
        self.eos = loaded.tokenizer.eos_id if loaded.tokenizer.eos_id is not None else loaded.config.eos_token_id
        self.device = loaded.device
        self.cache = self.model.new_cache(max_slots, self.max_len)
        self.slots = SlotAllocator(max_slots)
        self.waiting: collections.deque[GenerationRequest] = collections.deque()
        self.running: list[GenerationRequest] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._draining = False
        self._thread: threading.Thread | None = None
        metrics.kv_total.labels(name).set(max_slots)

    # ----------------------------------------------------------------------------------------------
    # Event-loop side
    # ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Graceful shutdown: refuse new requests, let queued and running ones finish (up to the timeout),
        then fail whatever is left."""
        self._draining = True
        deadline = time.perf_counter() + drain_timeout_s
        while (self.running or self.waiting) and time.perf_counter() < deadline and self._thread is not None:
            self._wake.set()
            time.sleep(0.02)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @torch.inference_mode()
    def score_prompt(self, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Log-probabilities of each prompt token given the ones before it (for `echo` with `logprobs`).
        The first token has none. Pure forward pass without the cache, so it can run beside the engine."""
        tokens = torch.tensor([prompt_ids], device=self.device)
        logits = self.model(tokens)[0, :-1].float()
        chosen, top_v, top_i = (t.tolist() for t in token_logprobs(logits, tokens[0, 1:], k))
        out: list[TokenLogprob | None] = [None]
        for tok, c, tv, ti in zip(prompt_ids[1:], chosen, top_v, top_i, strict=True):
            top = dict(zip(self.tokenizer.tokens(ti), tv, strict=True))
            out.append(TokenLogprob(self.tokenizer.tokens([tok])[0], c, top))
        return out

    def check_limits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty after tokenization")
        if prompt_len + max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's context of "
                f"{self.max_len} tokens; shorten the prompt or lower max_tokens"
            )

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> GenerationRequest:
        """Queue a request (raises QueueFull or ValueError). Must be called on the event loop."""
        self.check_limits(len(prompt_ids), params.max_tokens)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids)
        req = GenerationRequest(prompt_ids, params, asyncio.get_running_loop(),
                                time.perf_counter() + self.timeout_s, detok)
        with self._lock:
            if self._draining:
                raise QueueFull(f"model {self.name!r} is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"model {self.name!r} has {len(self.waiting)} requests waiting; retry later")
            self.waiting.append(req)
            self.metrics.queue_depth.labels(self.name).set(len(self.waiting))
        self._wake.set()
        return req

    async def stream(self, req: GenerationRequest) -> AsyncIterator[Event]:
        """Events of one request until it finishes. Leaving early (disconnect) cancels the request."""
        try:
            while True:
                event = await req.events.get()
                if event.error is not None:
                    raise event.error
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not req.finished:
                req.cancel()
                self._wake.set()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def slots_in_use(self) -> int:
        return self.slots.num_used

    # ----------------------------------------------------------------------------------------------
    # Worker thread
    # ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            if not self.running and not self.waiting:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    self.step()
            except Exception as exc:  # one bad batch fails its requests, never the engine
                log.exception("engine step failed", extra={"model": self.name})
                for req in list(self.running):
                    self._finish(req, Event(error=RuntimeError(f"generation failed: {type(exc).__name__}")))
        for req in list(self.running) + list(self.waiting):
            self._finish(req, Event(error=RuntimeError("server shutting down")))

    def step(self) -> None:
        now = time.perf_counter()
        for req in [r for r in self.running if r.cancelled or now > r.deadline]:
            self._finish(req, None if req.cancelled else Event(error=RequestTimeout("request timed out")))
        admitted = self._admit(now)
        if admitted:
            self._prefill(admitted)
        # In slot order: consecutive slots let the model read the cache through a view instead of a gather.
        ready = sorted((r for r in self.running if r.next_token is not None), key=lambda r: r.slot)
        if ready:
            self._decode(ready)
        self._update_gauges()

    def _admit(self, now: float) -> list[GenerationRequest]:
        admitted = []
        with self._lock:
            while self.waiting and (self.slots.num_free or self.waiting[0].cancelled):
                req = self.waiting.popleft()
                if req.cancelled:
                    req.finished = True
                    continue
                if now > req.deadline:
                    self._finish(req, Event(error=RequestTimeout("request timed out while queued")))
                    continue
                req.slot = self.slots.allocate(1)[0]
                admitted.append(req)
        self.running.extend(admitted)
        return admitted

    def _prefill(self, reqs: list[GenerationRequest]) -> None:
        lengths = [len(r.prompt_ids) for r in reqs]
        tokens = torch.zeros(len(reqs), max(lengths), dtype=torch.long)
        for i, r in enumerate(reqs):
            tokens[i, : lengths[i]] = torch.tensor(r.prompt_ids)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        logits = self.model.prefill(tokens.to(self.device), torch.tensor(lengths, device=self.device),
                                    self.cache, slots)
        self.metrics.batch_size.labels(self.name).observe(len(reqs))
        self._sample_and_emit(reqs, logits)

    def _decode(self, reqs: list[GenerationRequest]) -> None:
        positions = [len(r.prompt_ids) + len(r.generated) - 1 for r in reqs]
        dev = self.device
        logits = self.model.decode_step(
            torch.tensor([r.next_token for r in reqs], device=dev), torch.tensor(positions, device=dev),
            self.cache, torch.tensor([r.slot for r in reqs], device=dev), kv_len=max(positions) + 1,
        )
        self.metrics.batch_size.labels(self.name).observe(len(reqs))
        self._sample_and_emit(reqs, logits)

    def _sample_and_emit(self, reqs: list[GenerationRequest], logits: torch.Tensor) -> None:
        logits = logits.float()
        dev = logits.device
        params = [r.params for r in reqs]
        if any(p.penalized for p in params):
            counts = torch.stack([self._counts(r) for r in reqs])
            logits = apply_penalties(logits, counts, torch.tensor([p.presence_penalty for p in params], device=dev),
                                     torch.tensor([p.frequency_penalty for p in params], device=dev))
        if self.eos is not None:
            ban = [i for i, r in enumerate(reqs) if r.params.ignore_eos or len(r.generated) < r.params.min_tokens]
            if ban:
                logits[ban, self.eos] = float("-inf")
        tokens = sample(
            logits,
            torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([max(p.top_k, 0) for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            [r.generator for r in reqs],
        )
        n_top = max((p.logprobs or 0) for p in params)
        want_logprobs = any(p.logprobs is not None for p in params)
        if want_logprobs:
            chosen, top_v, top_i = (t.tolist() for t in token_logprobs(logits, tokens, n_top))
        now = time.perf_counter()
        for i, (req, token) in enumerate(zip(reqs, tokens.tolist(), strict=True)):
            lp = None
            if want_logprobs and req.params.logprobs is not None:
                k = req.params.logprobs
                top = {self.tokenizer.tokens([t])[0]: v for t, v in zip(top_i[i][:k], top_v[i][:k], strict=True)}
                lp = TokenLogprob(self.tokenizer.tokens([token])[0], chosen[i], top)
            self._append(req, token, lp, now)

    def _counts(self, req: GenerationRequest) -> torch.Tensor:
        if req.counts is None:
            req.counts = torch.zeros(self.model.cfg.vocab_size, device=self.device)
            for t in req.generated:
                req.counts[t] += 1
        return req.counts

    def _append(self, req: GenerationRequest, token: int, lp: TokenLogprob | None, now: float) -> None:
        p = req.params
        is_eos = token == self.eos and not p.ignore_eos
        finish = None
        if is_eos:
            text, finish = req.stops.flush() + req.detok.flush(), "stop"
        else:
            req.generated.append(token)
            if req.counts is not None:
                req.counts[token] += 1
            text, stopped = req.stops.feed(req.detok.push(token))
            if stopped:
                finish = "stop"
            elif len(req.generated) >= p.max_tokens or len(req.prompt_ids) + len(req.generated) >= self.max_len:
                text += req.stops.feed(req.detok.flush())[0] + req.stops.flush()
                finish = "length"
        if req.last_emit == 0.0:
            self.metrics.ttft.labels(self.name).observe(now - req.arrival)
        else:
            self.metrics.itl.labels(self.name).observe(now - req.last_emit)
        req.last_emit = now
        self.metrics.generated_tokens.labels(self.name).inc()
        req.next_token = token
        event = Event(text, [] if is_eos else [token], [lp] if lp is not None and not is_eos else [], finish)
        if finish is not None:
            self._finish(req, event)
        else:
            req.emit(event)

    def _finish(self, req: GenerationRequest, event: Event | None) -> None:
        """Retire a request: free its slot and send its last event (None: it was cancelled)."""
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        if req.slot >= 0:
            self.slots.free([req.slot])
            req.slot = -1
        if event is not None:
            req.emit(event)

    def _update_gauges(self) -> None:
        m, name = self.metrics, self.name
        m.queue_depth.labels(name).set(len(self.waiting))
        m.running.labels(name).set(len(self.running))
        m.kv_in_use.labels(name).set(self.slots.num_used)
