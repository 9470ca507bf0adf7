"""A reader that fell behind its request's stream (`Worker.stream(req, coalesce=True)`, what the HTTP routes read):
the events already waiting come as one, with the same text and ids as read one by one; events that must stay apart
(logprobs, an error) do; and the served model's single-stream path closes its stream at once when its reader leaves."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from tests.helpers import factories
from tests.helpers.polling import until
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics

TOKENS = 12


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("lm")), device="cpu")


@pytest.fixture
def engine(lm):
    engine = GenerationEngine("lm", lm, metrics=Metrics(), max_slots=4, max_queue=8, max_model_len=None,
                              timeout_s=60.0)
    engine.start()
    yield engine
    engine.stop()


async def _read(engine, req, coalesce: bool) -> list:
    async def read() -> list:
        return [event async for event in engine.stream(req, coalesce=coalesce)]

    return await asyncio.wait_for(read(), 10)  # a lost last event would leave the reader waiting


async def _all_waiting(req, n: int) -> None:
    """Until the request's `n` events are all delivered, none read."""
    for _ in range(1000):
        if req.events.qsize() >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{req.events.qsize()} of {n} events delivered")


def _params(**kw) -> SamplingParams:
    return SamplingParams(**({"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True} | kw))


def test_waiting_tokens_come_as_one_event_with_the_same_text_and_ids(engine, lm):
    prompt = lm.tokenizer.encode("the quick brown")

    async def run():
        one_by_one = await _read(engine, engine.submit(prompt, _params()), coalesce=False)
        late = engine.submit(prompt, _params())
        await _all_waiting(late, TOKENS)
        return one_by_one, await _read(engine, late, coalesce=True)

    one_by_one, joined = asyncio.run(run())
    assert len(one_by_one) == TOKENS and all(len(e.token_ids) == 1 for e in one_by_one)
    assert len(joined) == 1
    (event,) = joined
    assert event.token_ids == [t for e in one_by_one for t in e.token_ids]
    assert event.text == "".join(e.text for e in one_by_one) and len(set(event.token_ids)) > 2
    assert event.finish_reason == one_by_one[-1].finish_reason == "length"


def test_a_reader_that_keeps_up_gets_one_event_a_token(engine, lm):
    async def run():
        return await _read(engine, engine.submit(lm.tokenizer.encode("the quick"), _params()), coalesce=True)

    events = asyncio.run(run())
    assert sum(len(e.token_ids) for e in events) == TOKENS and events[-1].finish_reason == "length"


def test_tokens_with_logprobs_stay_one_event_each(engine, lm):
    """Each logprob entry keeps the text offset its token starts at: such events are not joined."""
    prompt = lm.tokenizer.encode("the quick brown")

    async def run():
        late = engine.submit(prompt, _params(logprobs=2))
        await _all_waiting(late, TOKENS)
        return await _read(engine, late, coalesce=True)

    events = asyncio.run(run())
    assert len(events) == TOKENS and all(len(e.token_ids) == len(e.logprobs) == 1 for e in events)


def test_tokens_before_an_error_come_first_then_the_error(engine, lm, monkeypatch):
    """A step that fails after some tokens: the waiting tokens come joined, then the error is raised."""
    original, calls = lm.model.decode_step, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(lm.model, "decode_step", failing)
    got = []

    async def run():
        late = engine.submit(lm.tokenizer.encode("the quick brown"), _params())
        await until(lambda: late.finished)
        await asyncio.sleep(0.1)  # its last events delivered
        async def read():
            async for event in engine.stream(late, coalesce=True):
                got.append(event)

        await asyncio.wait_for(read(), 10)  # an error lost behind the joined tokens would leave the reader waiting

    with pytest.raises(RuntimeError, match="generation failed"):
        asyncio.run(run())
    assert len(got) == 1 and len(got[0].token_ids) == 5 and got[0].finish_reason is None


def test_the_single_stream_path_closes_its_stream_when_its_reader_leaves(lm):
    """n = 1 is read without a task between the engine and the route: a reader that leaves after the first event
    cancels the request and frees its row at once, and the request's observer (tracing) sees it end; and it is
    read coalesced."""
    from tserve.service.engine import request as engine_request
    from tserve.service.generation.served import ServedLanguageModel
    from tserve.service.settings import Settings

    served = ServedLanguageModel("lm", lm, Settings(max_running_requests=2, cuda_graphs=False), Metrics())
    seen = []
    served.worker.start()
    try:
        async def run():
            token = engine_request.request_observer.set(seen.append)
            try:
                (req,) = served.submit([(lm.tokenizer.encode("the quick"),
                                         SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))])
            finally:
                engine_request.request_observer.reset(token)
            async with aclosing(served.events([req])) as events:
                async for i, event in events:
                    assert i == 0 and event.token_ids
                    break
            assert req.cancelled and seen == [req]
            await until(lambda: served.engine.slots_in_use == 0)
            # What the routes read: the waiting tokens of a reader that fell behind as one event.
            (late,) = served.submit([(lm.tokenizer.encode("the quick"), _params())])
            await _all_waiting(late, TOKENS)
            async with aclosing(served.events([late])) as events:
                got = [event async for _, event in events]
            assert len(got) == 1 and len(got[0].token_ids) == TOKENS

        asyncio.run(run())
    finally:
        served.worker.stop()
