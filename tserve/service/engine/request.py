"""What a worker holds: requests with a stream (event loop side) and lifecycle flags (both sides), the
events they receive, and the errors a request can end with. No HTTP in here."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from tserve.model.decoding.constrained_beam import ConstraintsUnmet


class QueueFull(Exception):
    """The waiting queue is at capacity (HTTP 429: retry later)."""


class ShuttingDown(QueueFull):
    """The worker takes no new request: the server drains, or the model is being unloaded or replaced (HTTP 503,
    as the readiness gate answers a request that comes a moment later)."""


class RequestTimeout(Exception):
    """A request ran past its deadline."""


class OutOfMemory(Exception):
    """The device ran out of memory even for this request alone (HTTP 503: retry later)."""


class InvalidInput(ValueError):
    """Input the model cannot take (HTTP 400); `code` names the kind when the caller's default does not, `param`
    the request field at fault when one is."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


def request_error(exc: BaseException) -> Exception:
    """What a request that hit `exc` in a worker reports: no internals, only the kind of failure."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return OutOfMemory("the device is out of memory; retry later or with a smaller request")
    if isinstance(exc, ConstraintsUnmet):  # the client's to know: which glossary terms did not fit
        return exc
    return RuntimeError(f"generation failed: {type(exc).__name__}")


@dataclass(frozen=True)
class Admission:
    """Whose a request is and how urgent, for a worker's admission order: `client` (an API key, else the
    client's address; None: anonymous) and `priority` (lower is admitted first, as vLLM's `priority`); `floor`:
    the most urgent priority a request's body may ask for (its key's, when the operator set one)."""

    client: object = None
    priority: int = 0
    floor: int | None = None


# Set per client request before its engine requests are made (the API layer does, from the key and the body);
# every engine request made in that context carries it.
admission: ContextVar[Admission] = ContextVar("admission", default=Admission())  # noqa: B039 - frozen
# Called with each engine request once its stream has ended (on the event loop), when set in the context the
# request was made in: how tracing (tserve/service/tracing.py) sees the request's timeline. None: nothing to do.
request_observer: ContextVar[Callable[[EngineRequest], None] | None] = ContextVar("request_observer", default=None)


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
    result: Any = None  # what a batch item or a call job computed (its only event)
    # (token, is_eos): the text is left to the stream's reader (`EngineRequest.render`), off the engine's thread
    text_pending: tuple[int, bool] | None = None
    # Where the token's text starts in the request's whole text (None: where `text` starts). The two differ while
    # a stop string may begin: the text held back is sent later, but each token's offset is its own.
    text_start: int | None = None


class EngineRequest:
    """The part of a request both sides touch: its stream (event loop) and its lifecycle flags."""

    def __init__(self, deadline: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.deadline = deadline
        self.cancelled = False
        self.finished = False
        self.last_emit = 0.0
        # A client request submitted as several engine requests (a document's sentences) shares one `group`:
        # it counts once toward --max-queue. `turn` orders admission: a request's k-th part waits behind every
        # other request's earlier parts, so that a short request is not held back by a long document.
        self.group: object = self
        self.turn = 0
        who = admission.get()
        self.client, self.priority = who.client, who.priority
        # The timeline, in wall-clock nanoseconds (0: not yet), and what it did, for whoever observes it.
        self.observer = request_observer.get()
        self.model = ""  # the engine's name, set when queued
        self.queued_ns, self.admitted_ns, self.first_token_ns, self.finished_ns = time.time_ns(), 0, 0, 0
        self.admitted_step = -1
        self.input_tokens = self.output_tokens = 0
        self.finish_reason: str | None = None
        self.finished_step = -1  # the engine step at which it finished (-1: not yet)

    def render(self, event: Event) -> Event:
        """The event as its client sees it (on the event loop): what the engine left to the reader."""
        return event

    def join(self, first: Event, then: Event) -> Event | None:
        """One event that says what `first` then `then` say, for a reader that reads them together; None where
        they must stay apart (by default, always)."""
        return None

    def cancel(self) -> None:
        """Called from the event loop when the client goes away; the engine frees its rows next step."""
        self.cancelled = True

    def emit(self, event: Event) -> None:
        self.output_tokens += len(event.token_ids)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        pending = getattr(_outbox, "pending", None)
        if pending is not None:  # inside a worker step: delivered with the step's other events
            pending.setdefault(self.loop, []).append((self, event))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop that submitted it has closed: nobody is listening any more
            self.cancelled = True


# The events a worker thread's step emits, by event loop (see `step_outbox`).
_outbox = threading.local()


def _deliver(items: list[tuple[EngineRequest, Event]]) -> None:
    for req, event in items:
        req.events.put_nowait(event)


@contextmanager
def step_outbox() -> Iterator[None]:
    """Collect the events emitted in this thread and hand them to each event loop in one call at the end: one
    wake-up of the loop per step instead of one per running request (with 64 requests, the per-event hand-off
    was a seventh of the worker's time and as much again on the loop). Events keep their order."""
    _outbox.pending = pending = {}
    try:
        yield
    finally:
        _outbox.pending = None
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop has closed: nobody is listening any more
                for req, _ in items:
                    req.cancelled = True


class CallRequest(EngineRequest):
    """Model work that is not a token stream (attention maps, prompt scoring): it waits in the same queue as
    the worker's other requests (limits, deadline, cancel), runs in the worker's thread between steps, holds
    no rows, and its one event carries the result. A ValueError it raises is the caller's bad input and
    reaches the caller as it is; any other exception fails this call alone."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], deadline: float) -> None:
        super().__init__(deadline)
        self.fn, self.args = fn, args

    def run(self) -> Event:
        try:
            return Event(finish_reason="stop", result=self.fn(*self.args))
        except ValueError as exc:
            return Event(error=exc)
