"""One behaviour suite for the three workers that hold requests: the language-model engine, the translation
engine and the classification batcher. Each runs with room for one request at a time and one waiting, and
with work slow enough (slowed engine steps, a slow batch function) that a request is still running when the
test acts on it, until the test lets the work go at full speed to collect the results. The same tests, through a small adapter per worker: a full queue refuses, a cancelled
waiting request is never computed, stopping lets held requests finish while new ones are refused, a request
past its deadline fails with a timeout, and call jobs (attention maps, prompt scoring) wait in the same queue."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import factories
from tests.helpers.hooked_server import slow_steps
from tests.helpers.polling import until
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams
from tserve.service.engine import (
    DynamicBatcher,
    GenerationEngine,
    QueueFull,
    RequestTimeout,
    TranslationEngine,
)
from tserve.service.engine.translation_input import Translator
from tserve.service.metrics import Metrics

STEP_S = 0.02  # engine steps slowed to this until released: a 60-token request runs for more than a second
BATCH_S = 0.6  # the batch function's time for a "long" item until released


class Worker:
    """What the suite needs of a worker: submit a long or short job, wait for its result, cancel it, and how
    many jobs it holds (running + waiting)."""

    def __init__(self, start: Callable[..., Any]) -> None:
        self._start = start
        self.inner: Any = None
        self.released = threading.Event()  # set: the slow work goes at full speed (the test has done its acting)

    def start(self, **limits: Any) -> Worker:
        self.inner = self._start(self, **limits)
        self.inner.start()
        return self

    def submit(self, name: str, long: bool) -> Any:
        raise NotImplementedError

    async def result(self, job: Any) -> str:
        raise NotImplementedError

    def cancel(self, job: Any) -> None:
        raise NotImplementedError

    def held(self) -> int:
        raise NotImplementedError

    @property
    def computed(self) -> list[str]:
        """The jobs the worker did any work for."""
        raise NotImplementedError

    async def results(self, *jobs: Any, release: bool = True) -> list[str]:
        """Every job's result, the slow work released first unless told not to; a worker that stopped working
        fails here instead of hanging the suite."""
        if release:
            self.released.set()
        return list(await asyncio.wait_for(asyncio.gather(*(self.result(j) for j in jobs)), timeout=20))


class EngineWorker(Worker):
    def __init__(self, start: Callable[..., Any], make_job: Callable[[str, bool], Any]) -> None:
        super().__init__(start)
        self.make_job = make_job
        self.submitted: list[tuple[str, Any]] = []

    @property
    def computed(self) -> list[str]:
        """Whoever read them: the jobs with a token generated."""
        return [name for name, req in self.submitted if req.generated]

    def submit(self, name: str, long: bool) -> Any:
        req = self.inner.submit_job(self.make_job(name, long))
        self.submitted.append((name, req))
        return req

    async def result(self, req: Any) -> str:
        async for _ in self.inner.stream(req):
            pass
        return next(name for name, r in self.submitted if r is req)

    def cancel(self, req: Any) -> None:
        req.cancel()

    def held(self) -> int:
        return len(self.inner.running) + self.inner.queue_depth


class BatcherWorker(EngineWorker):
    def __init__(self, start: Callable[..., Any]) -> None:
        super().__init__(start, lambda name, long: (name, long))
        self.done: list[str] = []  # appended by the batch function

    @property
    def computed(self) -> list[str]:
        return self.done

    async def result(self, req: Any) -> str:
        return await self.inner.result(req)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("lm")), device="cpu")


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("mt"), trained=False), device="cpu")


def lm_worker(lm) -> Worker:  # noqa: ANN001
    def start(w: Worker, max_queue: int = 1, timeout_s: float = 60.0) -> GenerationEngine:
        return slow_steps(GenerationEngine("lm", lm, max_slots=1, max_queue=max_queue, max_model_len=None,
                                           timeout_s=timeout_s, metrics=Metrics()), STEP_S, w.released)

    prompt = lm.tokenizer.encode("Hello world")
    return EngineWorker(start, lambda name, long: (prompt, SamplingParams(max_tokens=60 if long else 2,
                                                                          temperature=0.0, ignore_eos=True)))


def mt_worker(mt) -> Worker:  # noqa: ANN001 - random weights: it writes to its length limit
    translator = Translator(mt)

    def start(w: Worker, max_queue: int = 1, timeout_s: float = 60.0) -> TranslationEngine:
        return slow_steps(TranslationEngine("mt", mt, max_rows=1, max_queue=max_queue, timeout_s=timeout_s,
                                            metrics=Metrics()), STEP_S, w.released)

    return EngineWorker(start, lambda name, long: translator.job("hello world", 1, 60 if long else 2))


def batcher_worker() -> Worker:
    def start(w: BatcherWorker, max_queue: int = 1, timeout_s: float = 60.0) -> DynamicBatcher:
        def batch_fn(items: list[tuple[str, bool]]) -> list[str]:
            if any(long for _, long in items):
                w.released.wait(BATCH_S)
            w.done.extend(name for name, _ in items)
            return [name for name, _ in items]

        return DynamicBatcher("b", batch_fn, max_batch_size=1, max_wait_ms=0, max_queue=max_queue,
                              timeout_s=timeout_s, metrics=Metrics())

    return BatcherWorker(start)


@pytest.fixture(params=["lm-engine", "translation-engine", "batcher"])
def worker(request, lm, mt) -> Worker:
    return {"lm-engine": lambda: lm_worker(lm), "translation-engine": lambda: mt_worker(mt),
            "batcher": batcher_worker}[request.param]()


def test_a_full_queue_refuses(worker):
    w = worker.start(max_queue=1)

    async def run() -> None:
        running = w.submit("running", long=True)
        await until(lambda: w.held() == 1 and w.inner.queue_depth == 0)  # taken: the queue is empty again
        waiting = w.submit("waiting", long=False)
        with pytest.raises(QueueFull):
            w.submit("refused", long=False)
        assert await w.results(running, waiting) == ["running", "waiting"]

    try:
        asyncio.run(run())
    finally:
        w.inner.stop(drain_timeout_s=0)
    assert w.computed == ["running", "waiting"]


def test_the_queue_is_counted_safely_while_requests_arrive(worker):
    """The gauges count the waiting requests from the worker's thread (and /metrics from others) while the
    event loop's thread appends to the queue: the count must not iterate a queue that changes under it."""
    w = worker.start(max_queue=5000)
    failures: list[BaseException] = []
    done = threading.Event()

    def count() -> None:
        while not done.is_set():
            try:
                w.inner.queue_depth  # noqa: B018 - the read is the test
            except Exception as exc:  # noqa: BLE001
                failures.append(exc)
                return

    async def run() -> None:
        jobs = [w.submit(f"job {i}", long=True) for i in range(400)]
        assert w.inner.queue_depth >= 300
        for job in jobs:
            w.cancel(job)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads inside a count, so that a race shows at once
    reader = threading.Thread(target=count)
    reader.start()
    try:
        asyncio.run(run())
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
        w.released.set()
        w.inner.stop(drain_timeout_s=0)
    assert failures == []


def test_a_cancelled_waiting_request_is_never_computed(worker):
    w = worker.start(max_queue=2)

    async def run() -> None:
        running = w.submit("running", long=True)
        await until(lambda: w.held() == 1 and w.inner.queue_depth == 0)  # taken: the queue is empty again
        dropped, kept = w.submit("dropped", long=False), w.submit("kept", long=False)
        assert w.inner.queue_depth == 2
        w.cancel(dropped)
        assert await w.results(running, kept) == ["running", "kept"]
        await until(lambda: w.held() == 0)

    try:
        asyncio.run(run())
    finally:
        w.inner.stop(drain_timeout_s=0)
    assert w.computed == ["running", "kept"]


def test_stopping_finishes_held_requests_and_refuses_new_ones(worker):
    w = worker.start(max_queue=1)

    async def run() -> None:
        held = [w.submit("running", long=True)]
        await until(lambda: w.held() == 1 and w.inner.queue_depth == 0)
        held.append(w.submit("waiting", long=False))
        stopper = threading.Thread(target=w.inner.stop, kwargs={"drain_timeout_s": 30})
        stopper.start()
        await until(lambda: w.inner._draining)  # the stopper has begun
        with pytest.raises(QueueFull, match="shutting down"):
            w.submit("late", long=False)
        assert await w.results(*held) == ["running", "waiting"]
        await asyncio.to_thread(stopper.join)

    asyncio.run(run())
    assert w.computed == ["running", "waiting"]


def test_a_drain_waits_for_a_request_on_its_way_from_the_queue_to_the_rows(worker):
    """While a request is admitted it has left the queue and not yet joined the running list; a drain that
    looked then would find nothing to wait for and fail it with "shutting down". The admission is held at
    that point while the drain begins."""
    w = worker.start(max_queue=1)
    entered, go = threading.Event(), threading.Event()
    reserve = w.inner._reserve

    def held_reserve(req: Any) -> bool:
        entered.set()
        go.wait(timeout=10)
        return reserve(req)

    w.inner._reserve = held_reserve

    async def run() -> None:
        job = w.submit("only", long=True)  # more than one step: it is still running when the drain would stop
        assert await asyncio.to_thread(entered.wait, 10)
        stopper = threading.Thread(target=w.inner.stop, kwargs={"drain_timeout_s": 30})
        stopper.start()
        await until(lambda: w.inner._draining)
        await asyncio.sleep(0.3)  # a drain that can see the request in neither place has seen it by now
        go.set()
        assert await w.results(job) == ["only"]
        await asyncio.to_thread(stopper.join)

    asyncio.run(run())


def test_a_request_past_its_deadline_while_queued_times_out(worker):
    w = worker.start(max_queue=1)

    async def run() -> None:
        running = w.submit("running", long=True)
        await until(lambda: w.held() == 1 and w.inner.queue_depth == 0)
        waiting = w.submit("waiting", long=False)
        waiting.deadline = time.perf_counter() + 0.1
        with pytest.raises(RequestTimeout, match="while queued"):
            await w.results(waiting, release=False)  # the running one still holds the only row
        assert await w.results(running) == ["running"]

    try:
        asyncio.run(run())
    finally:
        w.inner.stop(drain_timeout_s=0)
    assert w.computed == ["running"]


@pytest.mark.parametrize("which", ["lm-engine", "translation-engine"])
def test_a_running_request_past_its_deadline_times_out(which, lm, mt):
    """The engines only: a batch item finishes in the step that runs it."""
    w = (lm_worker(lm) if which == "lm-engine" else mt_worker(mt)).start(timeout_s=0.3)

    async def run() -> None:
        with pytest.raises(RequestTimeout):
            await w.results(w.submit("slow", long=True), release=False)
        await until(lambda: w.held() == 0)

    try:
        asyncio.run(run())
    finally:
        w.inner.stop(drain_timeout_s=0)


def test_a_call_job_waits_in_the_same_queue_and_runs_in_the_worker_thread(worker):
    """Model work beside the token streams (attention maps, prompt scoring): it takes a place in the queue
    (--max-queue counts it), is never run once cancelled, runs in the worker's own thread, and a ValueError it
    raises reaches the caller as it is."""
    w = worker.start(max_queue=2)
    ran: list[str] = []

    def job(name: str) -> str:
        ran.append(threading.current_thread().name)
        if name == "bad":
            raise ValueError("bad input")
        return name.upper()

    async def run() -> None:
        running = w.submit("running", long=True)
        await until(lambda: w.held() == 1 and w.inner.queue_depth == 0)
        dropped, kept = w.inner.call(job, "dropped"), w.inner.call(job, "kept")
        with pytest.raises(QueueFull):
            w.submit("refused", long=False)
        dropped.cancel()
        w.released.set()
        assert await asyncio.wait_for(w.inner.result(kept), 20) == "KEPT"
        with pytest.raises(ValueError, match="bad input"):
            await asyncio.wait_for(w.inner.result(w.inner.call(job, "bad")), 20)
        assert await w.results(running) == ["running"]

    try:
        asyncio.run(run())
    finally:
        w.inner.stop(drain_timeout_s=0)
    assert len(ran) == 2 and set(ran) == {w.inner._thread.name}


def test_a_steps_latencies_observed_at_once_fill_the_buckets_one_by_one_would():
    """The engine records a step's inter-token latencies in one call (`observe_all`): the same buckets, count and
    sum as observing each, values on a bucket's bound and past the last one included."""
    from tserve.service.metrics import Metrics, observe_all  # noqa: PLC0415

    values = [0.0005, 0.001, 0.001, 0.0025, 0.003, 0.02, 0.64, 2.56, 3.0, 17.5, 0.0]
    at_once, each = Metrics(), Metrics()
    observe_all(at_once.itl.labels("m"), values)
    for v in values:
        each.itl.labels("m").observe(v)
    def series(m: Metrics) -> list[str]:
        return [line for line in m.render().decode().splitlines() if "inter_token" in line and "_created" not in line]

    lines = series(at_once)
    assert lines == series(each)
    assert 'tserve_inter_token_latency_seconds_bucket{le="0.001",model="m"} 4.0' in lines  # 0, 0.0005, 2 on it
