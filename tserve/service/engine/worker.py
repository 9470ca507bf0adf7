"""The scheduler every worker shares (no HTTP in here): waiting and running requests, admission (its policy:
--max-queue, priorities, the clients' turns, reserved rows, is `admission.py`'s), cancel and timeout, drain and
stop, the worker thread and its supervisor, call jobs.

A worker thread runs the step loop so that the event loop stays free:
    1. retire cancelled and timed-out requests (their rows are free for this very step),
    2. admit waiting requests while their rows fit, in admission order (`admission.py`: priority, then the
       clients in turn); call jobs among them run there and then,
    3. start the admitted requests as one batch (`_prefill`),
    4. advance every running request by one batched step (`_decode`), which emits events and retires the
       finished ones.
Requests join and leave between steps. Subclasses say what a request needs (`_reserve`/`_release`), how
admitted requests start and how running ones advance: `generation` (causal LM), `translation`
(encoder-decoder, beams) and `batcher` (one batch function call per step, for classification).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from tserve.model.checkpoint import select_device
from tserve.model.decoding.chosen_tokens import ChosenTokens
from tserve.service.engine.admission import admission_order, queue_refusal, takes_reserved_rows
from tserve.service.engine.request import (
    CallRequest,
    EngineRequest,
    Event,
    QueueFull,
    RequestTimeout,
    ShuttingDown,
    request_error,
    step_outbox,
)
from tserve.service.metrics import Metrics, observe_all

log = logging.getLogger("tserve.engine")
MAX_CLIENTS_REMEMBERED = 4096  # clients whose last admission is kept for the round-robin


class Worker:
    reports_cache = True  # rows are KV-cache rows (the kv gauges); the batcher's are not
    parts_take_turns = False  # a request's parts may run one batch after another (the batcher's items)
    thread_name = "engine"

    def __init__(self, name: str, *, max_queue: int, timeout_s: float, metrics: Metrics, capacity: int) -> None:
        self.name, self.max_queue, self.timeout_s, self.metrics = name, max_queue, timeout_s, metrics
        self.capacity = capacity
        self.device = torch.device("cpu")  # the model's; subclasses set it
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._draining = False
        self._thread: threading.Thread | None = None
        self.restarts = 0
        # Rows a client that already has requests running may not take: kept for another client's first request,
        # which then starts at once instead of waiting for a row to free (--reserved-rows).
        self.reserved_rows = 0
        self._admissions = 0
        self._last_admitted: dict[object, int] = {}  # client -> when it was last admitted (`_admissions`)
        self.steps = 0  # steps taken so far (each request records the one it finished at)
        # Asynchronous scheduling: steps launched whose tokens are not read yet, oldest first (`_launched`); with
        # `overlap`, a step's tokens are read once the next step is launched.
        self.overlap = False
        self._in_flight: list[ChosenTokens] = []
        # This step's inter-token latencies and tokens, recorded in the metrics once at its end.
        self._step_itl: list[float] = []
        self._step_tokens = 0
        # Tests only: called with each request as it is processed after a step; raising fails that request.
        self.fault_hook: Callable[[EngineRequest], None] | None = None
        self.m = metrics.for_model(name)
        if self.reports_cache:
            self.m.kv_total.set(capacity)

    # ----------------------------------------------------------------------------------------------
    # Event-loop side
    # ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        # Its queue's series exist from now on (a dashboard lists the models it finds in them), not from its first
        # request.
        self.m.queue_depth.set(self.queue_depth)
        self.m.running.set(len(self.running))
        self._thread = threading.Thread(target=self._loop, name=f"{self.thread_name}-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Graceful shutdown: refuse new requests, let queued and running ones finish (up to the timeout),
        then fail whatever is left."""
        self.refuse_new()
        deadline = time.perf_counter() + drain_timeout_s
        while not self.idle and time.perf_counter() < deadline and self._thread is not None:
            self._wake.set()
            time.sleep(0.02)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def replaced(self) -> None:
        """Another model serves this one's name now: while this one drains, its finished requests still count, but
        the name's gauges (running, waiting, the cache in use) are the new model's alone."""
        self.m = self.m.replaced()

    def refuse_new(self) -> None:
        """Start shutting down: new requests are refused from now on; queued and running ones go on."""
        self._draining = True

    @property
    def idle(self) -> bool:
        """Nothing running or waiting. Read under the lock: a request moving from the queue to the running list
        (or back, when preempted) is in neither for a moment, and a drain that looked then would stop early."""
        with self._lock:
            return not self.running and not self.waiting

    def _enqueue(self, req: EngineRequest, group: object | None = None, turn: int = 0) -> None:
        """Queue a request (raises QueueFull), as part `turn` of client request `group` when given. Must be
        called on the event loop."""
        if group is not None:
            req.group, req.turn = group, turn
        req.model = self.name
        with self._lock:
            if self._draining:
                raise ShuttingDown(f"model {self.name!r} is shutting down")
            self._purge_cancelled()
            if refusal := queue_refusal(req, self.waiting, self.max_queue, self.capacity - self.rows_in_use,
                                        self._rows_held, self.capacity if self.parts_take_turns else None):
                raise QueueFull(f"model {self.name!r} {refusal}; retry later")
            self.waiting.append(req)
            self.m.queue_depth.set(self._groups_waiting())
        self._wake.set()

    def submit_all(self, jobs: list[Any], *, one_request: bool = False, group: object | None = None,
                   first_turn: int = 0) -> list[EngineRequest]:
        """Queue every job or none: when one is refused (QueueFull, ValueError), those already queued are
        cancelled and the error is raised. The jobs are one client request's (its choices, its prompts, its
        images): they count once toward --max-queue. `one_request`: they are parts a client request is cut into
        (a document's sentences), admitted in turns with other requests' parts; `group` / `first_turn`: parts of
        a client request submitted in several calls (a pivot's second hop)."""
        submitted: list[EngineRequest] = []
        group = group if group is not None else object()
        try:
            for turn, job in enumerate(jobs, start=first_turn):
                submitted.append(self.submit_job(job, group=group, turn=turn if one_request else first_turn))
        except (QueueFull, ValueError):
            for req in submitted:
                req.cancel()
            raise
        return submitted

    def submit_job(self, job: Any, **part: Any) -> EngineRequest:
        """Queue one job; `part` (group=, turn=: which client request it is part of) is passed on to `_enqueue`."""
        raise NotImplementedError

    def call(self, fn: Callable[..., Any], *args: Any) -> CallRequest:
        """Queue `fn(*args)` as a job of this worker (raises QueueFull); `await worker.result(req)`."""
        req = CallRequest(fn, args, time.perf_counter() + self.timeout_s)
        self._enqueue(req)
        return req

    async def result(self, req: EngineRequest) -> Any:
        """The result of a call job or batch item once done (its error raised); leaving early cancels it."""
        async for event in self.stream(req):
            last = event
        return last.result

    async def stream(self, req: EngineRequest, coalesce: bool = False) -> AsyncIterator[Event]:
        """Events of one request until it finishes. Leaving early (disconnect) cancels the request.
        `coalesce`: events already waiting when one is read come as one where the request can join them
        (`EngineRequest.join`): a reader that fell behind (an event loop busy with many streams) catches up with
        one chunk, not one per token, as vLLM's output collector merges a request's outputs."""
        held: Event | None = None
        try:
            while True:
                if held is None:
                    event = req.render(await req.events.get())
                else:  # the event a join refused last time: read before any that came after it
                    event, held = held, None
                while coalesce and event.finish_reason is None and event.error is None and not req.events.empty():
                    later = req.render(req.events.get_nowait())
                    joined = req.join(event, later)
                    if joined is None:
                        held = later
                        break
                    event = joined
                if event.error is not None:
                    raise event.error
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not req.finished:
                req.cancel()
                self._wake.set()
            if req.observer is not None:
                req.observer(req)

    @property
    def queue_depth(self) -> int:
        """Client requests waiting (the parts of one count once)."""
        with self._lock:  # submitters append to the deque from the event loop's thread while this iterates it
            return self._groups_waiting()

    def _groups_waiting(self) -> int:
        """`queue_depth` for callers that hold the lock."""
        return len({r.group for r in self.waiting})

    # ----------------------------------------------------------------------------------------------
    # Worker thread
    # ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Supervisor: if the step loop itself dies, fail what was in flight and start it again."""
        select_device(self.device)
        while not self._stop:
            try:
                self._run_steps()
            except Exception as exc:
                log.exception("engine loop died; restarting it", extra={"model": self.name})
                self.restarts += 1
                for req in list(self.running):
                    self._fail(req, exc)
        with self._lock:
            left = list(self.running) + list(self.waiting)
        for req in left:
            self._finish(req, Event(error=RuntimeError("server shutting down")))

    def _run_steps(self) -> None:
        while not self._stop:
            if not self.running and not self.waiting:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with torch.inference_mode(), step_outbox():
                self.step()

    def _fail(self, req: EngineRequest, exc: BaseException) -> None:
        log.error("request failed", exc_info=exc, extra={"model": self.name})
        self._finish(req, Event(error=request_error(exc)))

    def _isolated(self, reqs: list, forward: Callable[[list], Any], consume: Callable[[list, Any], None]) -> None:
        """Run `consume(reqs, forward(reqs))` so that a fault fails only the requests it belongs to: when a
        batch fails, its requests run again one by one (re-writing a cache position is idempotent), and
        the one that fails alone is failed. `consume` must isolate its per-request part itself and do its
        batched part before it emits anything."""
        try:
            consume(reqs, forward(reqs))
        except Exception as exc:
            if len(reqs) == 1:
                self._fail(reqs[0], exc)
                return
            log.warning("batch failed; running its requests one by one", extra={"model": self.name,
                                                                                 "size": len(reqs)})
            for req in reqs:
                if not req.finished:
                    self._isolated([req], forward, consume)

    def _each(self, reqs: list, work: Callable[[Any], None]) -> None:
        """`work(req)` for every request; an exception fails that request alone."""
        for req in reqs:
            try:
                if self.fault_hook is not None:
                    self.fault_hook(req)
                work(req)
            except Exception as exc:
                self._fail(req, exc)

    def step(self) -> None:
        earlier = set(map(id, self._in_flight))  # launched by the step before: read once this step's are launched
        self._step()
        still = sum(id(c) in earlier for c in self._in_flight)  # the oldest ones, unless a rule read them already
        self._read_tokens(still if self.running else None)
        self._record_step_metrics()

    def _record_step_metrics(self) -> None:
        if self._step_itl:
            observe_all(self.m.itl, self._step_itl)
            self._step_itl = []
        if self._step_tokens:
            self.m.generated_tokens.inc(self._step_tokens)
            self._step_tokens = 0

    def _step(self) -> None:
        self.steps += 1
        now = time.perf_counter()
        for req in [r for r in self.running if r.cancelled or now > r.deadline]:
            self._finish(req, None if req.cancelled else Event(error=RequestTimeout("request timed out")))
        admitted = self._admit(now)
        if admitted:  # a long step (a batch, a prefill) shows its requests as running while it runs
            self._update_gauges()
        for call in [r for r in admitted if isinstance(r, CallRequest)]:
            self._run_call(call)
        admitted = [r for r in admitted if not isinstance(r, CallRequest)]
        if admitted:
            self._prefill(admitted)
        if self.running:
            self._decode()
        self._update_gauges()

    def _launched(self, reqs: list[EngineRequest], chosen: ChosenTokens) -> None:
        """A step's tokens are on their way: read now, or (with `overlap`) once the next step is launched."""
        self._in_flight.append(chosen)
        if not self.overlap:
            self._read_tokens()

    def _read_tokens(self, n: int | None = None) -> None:
        """Read the tokens of the `n` oldest steps on their way (default: all; waiting for the device) and hand
        them to their requests (`_take`); a request finished meanwhile (eos one step before, cancelled, failed)
        drops its row."""
        n = len(self._in_flight) if n is None else n
        steps, self._in_flight = self._in_flight[:n], self._in_flight[n:]
        for chosen in steps:
            try:
                tokens, logprobs = chosen.read()
            except Exception as exc:  # the device failed the step: its requests, not the engine
                for req in chosen.seqs:
                    if not req.finished:
                        self._fail(req, exc)
                continue
            live = [i for i, r in enumerate(chosen.seqs) if not r.finished]
            if live:
                self._take([chosen.seqs[i] for i in live], [tokens[i] for i in live],
                           None if logprobs is None else tuple([x[i] for i in live] for x in logprobs))

    def _run_call(self, call: CallRequest) -> None:
        try:
            if self.fault_hook is not None:
                self.fault_hook(call)
            event = call.run()
        except Exception as exc:
            self._fail(call, exc)
            return
        self.m.calls.inc()
        self._finish(call, event)

    def _purge_cancelled(self) -> None:
        """Drop cancelled requests from anywhere in the queue (call under the lock): behind a head that waits
        for rows they would otherwise keep counting toward --max-queue."""
        if any(r.cancelled for r in self.waiting):
            for r in self.waiting:
                r.finished = r.finished or r.cancelled
            self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)

    def _admit(self, now: float) -> list[EngineRequest]:
        """Waiting requests in admission order (`admission.admission_order`) while their rows fit (no overtaking: a large
        request at the head is not starved by small ones behind it)."""
        admitted = []
        with self._lock:
            self._purge_cancelled()
            if len({(r.priority, r.client) for r in self.waiting}) > 1 or any(r.turn for r in self.waiting):
                self.waiting = collections.deque(admission_order(self.waiting, self._last_admitted))
            kept: collections.deque[EngineRequest] = collections.deque()  # still waiting, in order
            try:
                while self.waiting:
                    req = self.waiting.popleft()
                    if req.cancelled:
                        req.finished = True
                    elif now > req.deadline:
                        self._finish(req, Event(error=RequestTimeout("request timed out while queued")))
                    elif not isinstance(req, CallRequest) and self._keeps_reserved_rows(req, admitted):
                        kept.append(req)  # passed over: its rows are for other clients, whose requests may follow
                    elif (fits := self._fits(req)) is None:
                        continue  # it failed alone
                    elif fits:
                        admitted.append(req)
                        req.admitted_ns, req.admitted_step = time.time_ns(), self.steps
                        self._admissions += 1
                        self._last_admitted[req.client] = self._admissions
                    else:
                        kept.append(req)
                        kept.extend(self.waiting)  # no overtaking: nothing behind a request that does not fit
                        self.waiting.clear()
            finally:  # (a fault in one request's retiring loses none of those taken off the queue: see `_loop`)
                kept.extend(self.waiting)
                self.waiting = kept
                self.running.extend(admitted)
            if len(self._last_admitted) > MAX_CLIENTS_REMEMBERED:  # forget the clients not waiting
                waiting = {r.client for r in self.waiting}
                self._last_admitted = {c: t for c, t in self._last_admitted.items() if c in waiting}
        return admitted

    def _fits(self, req: EngineRequest) -> bool | None:
        """Whether `req`'s rows are claimed now; None when claiming them failed (input its runner cannot hold):
        that request is failed and admission goes on, where the fault would otherwise lose it off the queue."""
        if isinstance(req, CallRequest):
            return True
        try:
            return self._reserve(req)
        except Exception as exc:  # noqa: BLE001 - the request's own failure, reported to it
            self._fail(req, exc)
            return None

    def _keeps_reserved_rows(self, req: EngineRequest, admitted: list[EngineRequest]) -> bool:
        """Whether admitting `req` would take rows reserved for other clients (`admission.takes_reserved_rows`)."""
        holds = any(r.client == req.client for r in (*self.running, *admitted) if not isinstance(r, CallRequest))
        return takes_reserved_rows(self._rows_needed(req), self.capacity - self.rows_in_use, self.reserved_rows,
                                   holds)

    def _requeue_preempted(self, req: EngineRequest, tokens: int) -> None:
        """A running request whose cache the engine has just given back (the pool ran dry) goes back to the head
        of the queue, counted and logged; admitted again, it recomputes its `tokens` positions."""
        with self._lock:
            self.running.remove(req)
            self.waiting.appendleft(req)
        self.m.preemptions.inc()
        log.info("request preempted: the KV cache is full", extra={"model": self.name, "tokens": tokens})

    def _publish(self, req: EngineRequest, event: Event, now: float) -> None:
        """Send a non-final event and record first-token / inter-token latency."""
        if req.last_emit == 0.0:
            self.m.ttft.observe(now - req.arrival)
            req.first_token_ns = time.time_ns()
        else:
            self._step_itl.append(now - req.last_emit)
        req.last_emit = now
        if event.finish_reason is not None:
            self._finish(req, event)
        else:
            req.emit(event)

    def _finish(self, req: EngineRequest, event: Event | None) -> None:
        """Retire a request: free its rows and send its last event (None: it was cancelled)."""
        req.finished, req.finished_step, req.finished_ns = True, self.steps, time.time_ns()
        if req in self.running:
            self.running.remove(req)
        try:
            if not isinstance(req, CallRequest):
                self._release(req)
        finally:  # its client hears how it ended even where giving its rows back failed
            if event is not None:
                req.emit(event)

    def _update_gauges(self) -> None:
        m = self.m
        m.queue_depth.set(self.queue_depth)
        m.running.set(len(self.running))
        if self.reports_cache:
            m.kv_in_use.set(self.rows_in_use)

    # ----------------------------------------------------------------------------------------------
    # What each kind of model fills in
    # ----------------------------------------------------------------------------------------------
    @property
    def rows_in_use(self) -> int:
        raise NotImplementedError

    def _rows_needed(self, req: EngineRequest) -> int:
        """Cache rows `req` takes once admitted."""
        return 1

    def _rows_held(self, req: EngineRequest) -> int:
        """`_rows_needed`, and none for a call job (it runs between steps and holds no rows)."""
        return 0 if isinstance(req, CallRequest) else self._rows_needed(req)

    def _reserve(self, req: EngineRequest) -> bool:
        """Claim the cache rows `req` needs; False when they are not free now."""
        raise NotImplementedError

    def _release(self, req: EngineRequest) -> None:
        """Give back whatever `_reserve` claimed (idempotent)."""
        raise NotImplementedError

    def _prefill(self, reqs: list[EngineRequest]) -> None:
        raise NotImplementedError

    def _decode(self) -> None:
        raise NotImplementedError

    def _take(self, reqs: list[EngineRequest], tokens: list[int], logprobs: tuple | None) -> None:
        """A step's tokens read from the device, row by row of `reqs` (those still running): engines that
        launch steps through `_launched` hand them to their requests here."""
        raise NotImplementedError


def overlaps(async_scheduling: str, device: torch.device) -> bool:
    """--async-scheduling: on, off, or auto (on where a device runs beside the host: CUDA)."""
    return async_scheduling == "on" or (async_scheduling == "auto" and device.type == "cuda")
