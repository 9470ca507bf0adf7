"""What /metrics and a response's usage report where two features meet in one request or one batch: sentences the
translation memory answers beside the engine's counters (a remembered sentence generates nothing, has no first
token, and streamed it reports the tokens a translated one does); the prefix cache's tokens for a request of several
choices, in usage and in the metrics alike; a beam request batched with a greedy one (a beam step is one token,
however many rows it holds); first-token and inter-token latencies of requests that a small KV pool preempts.
Engines and apps run in this process, so that the tests take seconds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.engine.test_option_combinations_scheduling import block_bytes, engine_of, same_length_prompts
from tests.engine.test_paged_engine import run_all
from tests.helpers import factories
from tests.helpers.fixture_training import lexicon_sentences
from tests.helpers.in_process import InProcessApp
from tserve.model.decoding import SamplingParams
from tserve.service.engine import TranslationEngine
from tserve.service.metrics import Metrics
from tserve.service.translation.served import collect_translation

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-pairs-app")
    served = InProcessApp({"lm": TINY_LM, "mt": factories.aligned_mt_dir(root / "mt")}, gc_freeze=False,
                          translation_memory=str(root / "memory.sqlite"))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return factories.tiny_lm_loaded(tmp_path_factory.mktemp("metrics-pairs-lm"), "layers")


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return factories.tiny_mt_loaded(tmp_path_factory.mktemp("metrics-pairs-mt"), "plain")


def metric(app: InProcessApp, name: str, model: str) -> float:
    return app.app.state.metrics.registry.get_sample_value(name, {"model": model}) or 0.0


def streamed(app: InProcessApp, path: str, body: dict) -> list[dict]:
    """The JSON chunks of an SSE answer, read through the app in this process."""
    async def go() -> list[dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://test",
                                     timeout=120) as client, client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            return [json.loads(line[6:]) async for line in resp.aiter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]

    return asyncio.run(go())


# --------------------------------------------------------------------------------------------------
# The translation memory beside the engine's counters and the usage
# --------------------------------------------------------------------------------------------------
def test_a_remembered_translation_generates_nothing_and_streamed_reports_the_usage_of_a_translated_one(app):
    """A sentence the memory holds is answered without the engine: no generated token, no first token more. The
    same sentence streamed from the memory comes in one chunk whose usage counts the translation's tokens, as the
    non-streamed answer (translated or remembered) does, not zero."""
    body = {"model": "mt", "input": "good morning my friend", "num_beams": 1, "max_tokens": 30}
    first = app.post("/v1/translations", body).json()  # translated by the engine and kept
    assert first["usage"]["completion_tokens"] > 0
    generated = metric(app, "tserve_generated_tokens_total", "mt")
    firsts = metric(app, "tserve_time_to_first_token_seconds_count", "mt")
    hits = metric(app, "tserve_translation_memory_hits_total", "mt")

    again = app.post("/v1/translations", body).json()
    chunks = streamed(app, "/v1/translations", body | {"stream": True})
    assert metric(app, "tserve_translation_memory_hits_total", "mt") == hits + 2
    assert metric(app, "tserve_generated_tokens_total", "mt") == generated
    assert metric(app, "tserve_time_to_first_token_seconds_count", "mt") == firsts
    assert again["usage"] == first["usage"]
    assert chunks[-1]["data"][0]["translation"] == first["data"][0]["translation"]
    assert chunks[-1]["usage"] == first["usage"]


# --------------------------------------------------------------------------------------------------
# The prefix cache with several choices: usage and metrics agree
# --------------------------------------------------------------------------------------------------
def test_the_cached_tokens_of_several_choices_in_usage_are_those_the_prefix_cache_metrics_count(app):
    """Three choices of one prompt are three engine requests: the first computes the prompt's blocks, the others
    wait for them and read them. Usage's cached_tokens adds each choice's own, as the metrics' cached-token counter
    does for the same request; it is not the first choice's (none) times three."""
    prompt = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire " * 2
    body = {"model": "lm", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 3}
    cached, hits = (metric(app, "tserve_prefix_cache_cached_tokens_total", "lm"),
                    metric(app, "tserve_prefix_cache_hits_total", "lm"))
    usage = app.post("/v1/completions", body).json()["usage"]
    read = metric(app, "tserve_prefix_cache_cached_tokens_total", "lm") - cached
    assert metric(app, "tserve_prefix_cache_hits_total", "lm") - hits == 2  # the second and third choices
    assert read >= 2 * 16  # at least a block each
    assert usage["prompt_tokens_details"]["cached_tokens"] == read
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] % 3 == 0


# --------------------------------------------------------------------------------------------------
# Beams batched with a greedy request
# --------------------------------------------------------------------------------------------------
def test_a_beam_request_batched_with_a_greedy_one_counts_one_token_a_step_not_one_a_row(mt):
    """A 4-beam and a 3-beam translation beside a greedy one, admitted in one step: each request's generated tokens
    are the steps it ran (a beam step is one position of its hypotheses, whatever its rows), so the counter reads the
    sum of the requests' steps, and no request more than its max_tokens."""
    engine = TranslationEngine("mt", mt, max_rows=16, max_queue=16, timeout_s=60.0, metrics=Metrics())
    texts = lexicon_sentences(3, seed=70, min_words=3, max_words=9)
    jobs = [engine.translator.job(texts[0], num_beams=4, max_tokens=20),
            engine.translator.job(texts[1], num_beams=1, max_tokens=20),
            engine.translator.job(texts[2], num_beams=3, max_tokens=20)]

    async def run() -> list:
        reqs = [engine.submit(j) for j in jobs]  # queued before the worker starts: admitted in one step
        engine.start()
        await asyncio.gather(*(collect_translation(engine, r) for r in reqs))
        return reqs

    try:
        reqs = asyncio.run(run())
    finally:
        engine.stop()
    steps = [r.finished_step - r.admitted_step + 1 for r in reqs]
    assert len({r.admitted_step for r in reqs}) == 1 and all(s <= 20 for s in steps)
    assert engine.m.generated_tokens._value.get() == sum(steps)


# --------------------------------------------------------------------------------------------------
# Latencies of preempted requests
# --------------------------------------------------------------------------------------------------
def test_a_preempted_request_has_one_first_token_and_a_gap_before_each_later_one(lm):
    """A pool too small for every request preempts some; admitted again, a request goes on from its tokens, so its
    first token was the one before the preemption: one first-token observation per request, and one inter-token
    gap per later token (the gap across the preemption included), as without preemption."""
    prompts = same_length_prompts(lm, 6, seed=43)
    jobs = [(p, SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine = engine_of(lm, max_slots=6, kv_cache_budget=(24 * block_bytes(lm), None), max_model_len=96)
    reqs = run_all(engine, jobs)
    m = engine.metrics.registry
    assert engine.m.preemptions._value.get() > 0
    assert m.get_sample_value("tserve_time_to_first_token_seconds_count", {"model": "lm"}) == len(reqs)
    assert m.get_sample_value("tserve_inter_token_latency_seconds_count", {"model": "lm"}) == \
        sum(len(r.generated) - 1 for r in reqs)
    assert engine.m.generated_tokens._value.get() == sum(len(r.generated) for r in reqs) == 30 * len(reqs)
