"""Admission between clients: a lower `priority` value first, and within a priority the clients in turn, so that
one client's flood holds another client's request back by a turn, not by the whole flood (in-process)."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import factories
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams
from tserve.service.engine import Admission, GenerationEngine, admission
from tserve.service.metrics import Metrics


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("lm")), device="cpu")


def _run(lm, batches: list[tuple[Admission, int]], max_slots: int = 2) -> list[list[int]]:
    """Submit each batch (who, how many requests of 6 tokens) in order, all before the engine starts; the step
    at which each request finished, per batch."""
    engine = GenerationEngine("lm", lm, metrics=Metrics(), max_slots=max_slots, max_queue=256, max_model_len=None,
                              timeout_s=60.0)
    prompt = lm.tokenizer.encode("Good morning")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def go() -> list[list[int]]:
        reqs = []
        for who, count in batches:
            token = admission.set(who)
            reqs.append([engine.submit(prompt, params) for _ in range(count)])
            admission.reset(token)
        engine.start()
        for batch in reqs:
            for r in batch:
                async for _ in engine.stream(r):
                    pass
        return [[r.finished_step for r in batch] for batch in reqs]

    try:
        return asyncio.run(go())
    finally:
        engine.stop()


def test_a_flood_holds_another_client_back_by_a_turn_only(lm):
    flood, alone = _run(lm, [(Admission("a"), 30), (Admission("b"), 1)])
    # Two rows: the flood's first two run; when one finishes, b's request is next, not the flood's third.
    assert alone[0] <= sorted(flood)[2]
    assert sum(step < alone[0] for step in flood) <= 2


def test_without_clients_arrival_order_holds(lm):
    (first, second) = _run(lm, [(Admission(), 30), (Admission(), 1)])
    assert second[0] >= max(first)  # the one client's requests in the order they came


def test_a_lower_priority_value_goes_first(lm):
    flood, urgent, later = _run(lm, [(Admission("a", 0), 12), (Admission("c", -1), 3), (Admission("d", 5), 1)])
    assert max(urgent) <= min(flood)  # all queued before the first step: the urgent ones run first
    assert later[0] >= max(flood)  # priority 5 waits for every priority-0 request



def test_priorities_mixed_within_one_client_are_each_requests_own(lm):
    """A client (one API key) sends most requests at the default priority, a few urgent ones and one that can
    wait: each request goes by its own priority, not by its client's (another client at the default priority is
    held back by a turn only, not by the urgent client's whole flood; the one that can wait goes last)."""
    flood, urgent, other, later = _run(lm, [(Admission("a", 0), 10), (Admission("a", -1), 2),
                                            (Admission("b", 0), 1), (Admission("a", 5), 1)])
    assert max(urgent) <= min(flood)  # a's urgent requests before any priority-0 one, its own included
    assert other[0] <= sorted(flood)[2]  # b in turn with a's priority-0 requests
    assert later[0] >= max(flood + other)  # a's priority 5 after every priority-0 request

def test_a_reserved_row_starts_another_clients_request_at_once(lm):
    """--reserved-rows 1: the flood runs on all rows but one, and the other client's request, queued behind
    the whole flood, starts on the kept row at the first step."""
    engine = GenerationEngine("lm", lm, metrics=Metrics(), max_slots=3, max_queue=256, max_model_len=None,
                              timeout_s=60.0)
    engine.reserved_rows = 1
    prompt = lm.tokenizer.encode("Good morning")

    async def go() -> tuple[list[int], int]:
        token = admission.set(Admission("a"))
        flood = [engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                 for _ in range(8)]
        admission.reset(token)
        engine.start()
        while len(engine.running) < 2:
            await asyncio.sleep(0.001)
        assert len(engine.running) == 2  # the third row is kept
        token = admission.set(Admission("b"))
        other = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        arrived = engine.steps  # the engine steps on meanwhile, in its own thread: counted from here, not from 0
        admission.reset(token)
        for r in [*flood, other]:
            async for _ in engine.stream(r):
                pass
        return [r.admitted_step for r in flood], other.admitted_step, arrived

    try:
        flood, other, arrived = asyncio.run(go())
    finally:
        engine.stop()
    assert other <= arrived + 1  # admitted at the next step after it came
    assert other < max(flood)  # ahead of the flood's queued requests, not behind them


def test_the_reserved_row_takes_the_other_clients_next_request_too(lm):
    """A client whose requests are passed over (its own run, the rows left are reserved) does not stop the
    scan: another client's second request, queued behind the flood, still starts on the kept row."""
    engine = GenerationEngine("lm", lm, metrics=Metrics(), max_slots=3, max_queue=256, max_model_len=None,
                              timeout_s=60.0)
    engine.reserved_rows = 1
    prompt = lm.tokenizer.encode("Good morning")

    def submit(who: str, tokens: int):
        token = admission.set(Admission(who))
        try:
            return engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        finally:
            admission.reset(token)

    async def go() -> tuple[list[int], list[int]]:
        flood = [submit("a", 24) for _ in range(8)]
        engine.start()
        mine = []
        for _ in range(2):  # one after the other: the second waits behind the flood's queued requests
            req = submit("b", 4)
            async for _ in engine.stream(req):
                pass
            mine.append(req.finished_step)
        for r in flood:
            async for _ in engine.stream(r):
                pass
        return [r.finished_step for r in flood], mine

    try:
        flood, mine = asyncio.run(go())
    finally:
        engine.stop()
    assert max(mine) < min(flood)  # both done before the flood's first requests
