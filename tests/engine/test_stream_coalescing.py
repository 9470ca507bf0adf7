"""A reader that fell behind its request's stream (`Worker.stream(req, coalesce=True)`, what the HTTP routes read):
the events already waiting come as one, with the same text and ids as read one by one; events that must stay apart
(logprobs, an error) do; the served model's single-stream path closes its stream at once when its reader leaves,
and several choices' streams come each with its index."""

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


@pytest.fixture
def served(lm):
    """The served language model the routes read (`ServedLanguageModel.events`), its worker running."""
    from tserve.service.generation.served import ServedLanguageModel
    from tserve.service.settings import Settings

    served = ServedLanguageModel("lm", lm, Settings(max_running_requests=4, cuda_graphs=False), Metrics())
    served.worker.start()
    yield served
    served.worker.stop()


def _fail_decode_steps(monkeypatch, lm, first: int, every: bool = False) -> None:
    """Decode step number `first` raises (`every`: that one and each after it, so that the engine's retry one
    request at a time fails too)."""
    original, calls = lm.model.decode_step, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == first or (every and calls["n"] > first):
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(lm.model, "decode_step", failing)


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


def test_a_coalesced_reader_gets_every_token_once_and_the_finish(engine, lm):
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


def test_join_keeps_apart_what_must_stay_apart(engine, lm):
    """Text and ids join; an entry with logprobs never joins (nor one after it: a logprobs request's eos event has
    none), nor a result or an error."""
    from tserve.service.engine import Event, TokenLogprob

    lp = TokenLogprob("a", -0.5, {})

    async def run():
        req = engine.submit(lm.tokenizer.encode("the"), _params(max_tokens=1))
        await _read(engine, req, coalesce=False)
        a, b = Event("a", [5]), Event("b", [6], finish_reason="length")
        joined = req.join(a, b)
        assert (joined.text, joined.token_ids, joined.finish_reason) == ("ab", [5, 6], "length")
        for first, then in ((Event("a", [5], [lp]), Event("", [], finish_reason="stop")),
                            (Event("a", [5]), Event("b", [6], [lp])),
                            (Event("a", [5], result=1), b), (a, Event(result=[1])), (a, Event(error=ValueError()))):
            assert req.join(first, then) is None, (first, then)

    asyncio.run(run())


def test_tokens_before_an_error_come_first_then_the_error(engine, lm, monkeypatch):
    """A step that fails after some tokens: the waiting tokens come joined, then the error is raised."""
    _fail_decode_steps(monkeypatch, lm, 5)
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


def test_the_single_stream_path_closes_its_stream_when_its_reader_leaves(served, lm):
    """n = 1 is read without a task between the engine and the route: a reader that leaves after the first event
    cancels the request and frees its row at once, and the request's observer (tracing) sees it end; and it is
    read coalesced."""
    from tserve.service.engine import request as engine_request

    seen = []

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


def test_several_choices_come_each_with_its_index_coalesced(served, lm):
    """n > 1: each request's events come with its index, joined where they waited, each text the text of its
    request alone; leaving early cancels every one of them."""
    prompts = [lm.tokenizer.encode(p) for p in ("the quick", "brown fox jumps", "over")]

    async def run():
        alone = [await _read(served.engine, served.submit([(p, _params())])[0], coalesce=False) for p in prompts]
        reqs = served.submit([(p, _params()) for p in prompts])
        for req in reqs:
            await _all_waiting(req, TOKENS)
        got = {i: [] for i in range(len(reqs))}
        async with aclosing(served.events(reqs)) as events:
            async for i, event in events:
                got[i].append(event)
        for i, events in got.items():
            assert len(events) == 1, i
            assert events[0].token_ids == [t for e in alone[i] for t in e.token_ids]
            assert events[0].text == "".join(e.text for e in alone[i])
        assert len({e[0].text for e in got.values()}) == len(prompts)
        reqs = served.submit([(p, _params(max_tokens=100)) for p in prompts])
        async with aclosing(served.events(reqs)) as events:
            async for _ in events:
                break
        assert all(r.cancelled for r in reqs)
        await until(lambda: served.engine.slots_in_use == 0)

    asyncio.run(run())


def test_an_error_in_one_of_several_choices_is_raised(served, lm, monkeypatch):
    _fail_decode_steps(monkeypatch, lm, 3, every=True)  # from the third step: its one-by-one retry fails too

    async def run():
        reqs = served.submit([(lm.tokenizer.encode(p), _params()) for p in ("the quick", "brown fox")])
        async with aclosing(served.events(reqs)) as events:
            async for _ in events:
                pass

    with pytest.raises(RuntimeError, match="generation failed"):
        asyncio.run(asyncio.wait_for(run(), 10))
