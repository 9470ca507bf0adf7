"""Admission between clients: a lower `priority` value first, and within a priority the clients in turn, so that
one client's flood holds another client's request back by a turn, not by the whole flood (in-process)."""

from __future__ import annotations

import asyncio

import pytest

from model import checkpoint
from model.decoding import SamplingParams
from service.engine import Admission, GenerationEngine, admission
from service.metrics import Metrics
from tests.helpers import factories


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
