"""In-process tests for behaviour that mutation testing (`make mutation`, docs/testing/mutation.md) found unchecked:
each one fails on mutants that survived the rest of the suite. No HTTP here.

Every test here also checks that no batch fell back to running its requests one by one: that fallback
(fault isolation) gives the same outputs, so a batching bug would otherwise pass unseen."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE, cycle_prompts, lexicon_sentences
from tests.helpers.hooked_server import slow_steps
from tests.helpers.one_request import job_tokens, lm_tokens
from tests.helpers.polling import until
from tserve.model import checkpoint
from tserve.model.decoding import BeamSearch, BeamSettings, SamplingParams
from tserve.service.engine import (
    DynamicBatcher,
    GenerationEngine,
    OutOfMemory,
    RequestTimeout,
    TranslationEngine,
    request_error,
)
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("lm")), device="cpu")


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("mt")), device="cpu")


@pytest.fixture(scope="module")
def lm_rand(tmp_path_factory):
    """The LM with random weights: flat distributions, which small penalties change."""
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("lm-rand"), trained=False), device="cpu")


@pytest.fixture(scope="module")
def lm_eos(tmp_path_factory):
    """The trained LM, changed so that it writes eos where it would write '.' (the eos row of the output
    layer is 1.1 x the row of '.'), as lm-eos in test_http_contract.py."""
    loaded = checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("lm-eos")), device="cpu")
    (dot,) = loaded.tokenizer.encode(".", add_special_tokens=False)
    with torch.no_grad():
        loaded.model.lm_head.weight[loaded.tokenizer.eos_id] = 1.1 * loaded.model.lm_head.weight[dot]
    return loaded


@pytest.fixture(autouse=True)
def no_one_by_one_fallback(caplog):
    caplog.set_level(logging.WARNING, logger="tserve.engine")
    yield
    fallbacks = [r.getMessage() for r in caplog.get_records("call")
                 if r.name == "tserve.engine" and "one by one" in r.getMessage()]
    assert not fallbacks, fallbacks


async def events_of(engine, req) -> list:  # noqa: ANN001
    return [event async for event in engine.stream(req)]


def lm_engine(loaded, **kw) -> GenerationEngine:  # noqa: ANN001
    engine = GenerationEngine("lm", loaded, metrics=Metrics(),
                              **({"max_slots": 4, "max_queue": 16, "max_model_len": None, "timeout_s": 60.0} | kw))
    engine.start()
    return engine


def run_all(engine, jobs: list) -> list:  # noqa: ANN001
    """Submit every job at once (LM jobs: (prompt ids, params)); the events of each, in order."""
    async def run() -> list:
        reqs = [engine.submit(*j) if isinstance(j, tuple) else engine.submit(j) for j in jobs]
        return await asyncio.gather(*(events_of(engine, r) for r in reqs), return_exceptions=True)

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def ids_of(events: list) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_logprobs_through_the_engine_equal_a_recompute(lm):
    """The chosen token's string and log-probability and the top alternatives, per request's own `logprobs`
    (requests without it get none), equal a forward pass over prompt + output without the cache."""
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(3, seed=5)]
    wanted = [2, 0, None]
    results = run_all(lm_engine(lm), [(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=k))
                                      for p, k in zip(prompts, wanted, strict=True)])
    for prompt, k, events in zip(prompts, wanted, results, strict=True):
        ids = ids_of(events)
        lps = [lp for e in events for lp in e.logprobs]
        assert len(ids) == 4
        if k is None:
            assert lps == []
            continue
        assert len(lps) == 4
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(torch.tensor([prompt + ids]))[0].float(), dim=-1)
        for i, (token, lp) in enumerate(zip(ids, lps, strict=True)):
            row = logp[len(prompt) - 1 + i]
            assert lp.token == lm.tokenizer.tokens([token])[0]
            assert math.isclose(lp.logprob, float(row[token]), abs_tol=1e-3)
            top_v, top_i = row.topk(k)
            assert list(lp.top) == lm.tokenizer.tokens(top_i.tolist())
            assert all(math.isclose(v, float(r), abs_tol=1e-3) for v, r in zip(lp.top.values(), top_v, strict=True))
            if k:
                assert lp.top[lp.token] == lp.logprob  # greedy: the chosen token is the most likely


def test_penalties_through_the_engine_equal_the_one_request_loop(lm_rand):
    """Presence and frequency penalties, batched with an unpenalised neighbour, give what `model.decoding.generate`
    gives for each request alone; and they change the output."""
    lm = lm_rand
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(3, seed=9)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=pp, frequency_penalty=fp)
              for pp, fp in ((1.0, 0.0), (0.0, 0.5), (0.0, 0.0))]
    reference = [lm_tokens(lm, p, sp) for p, sp in zip(prompts, params, strict=True)]
    plain = [lm_tokens(lm, p, params[2]) for p in prompts[:2]]
    assert reference[0] != plain[0] and reference[1] != plain[1]
    results = run_all(lm_engine(lm), list(zip(prompts, params, strict=True)))
    assert [ids_of(events) for events in results] == reference


def test_eos_min_tokens_and_ignore_eos_through_the_engine(lm_eos):
    """eos ends a request ("stop", eos itself not among the tokens); min_tokens holds it back for that many
    tokens, ignore_eos for all of max_tokens: as `model.decoding.generate` alone, batched together."""
    tok = lm_eos.tokenizer

    def ref(prompt: list[int], **kw) -> list[int]:
        return lm_tokens(lm_eos, prompt, SamplingParams(max_tokens=30, temperature=0.0, **kw), with_eos=False)

    # A sentence of the cycle without its '.': eos comes at once, and again within 30 tokens after it.
    prompt = next((p for p in (tok.encode(s[:-1]) for s in CYCLE if s.endswith("."))
                   if not ref(p) and len(ref(p, min_tokens=1)) < 30), None)
    assert prompt is not None
    first_stop = len(ref(prompt, min_tokens=1))
    variants = [{}, {"min_tokens": 1}, {"min_tokens": first_stop + 1}, {"ignore_eos": True}]
    expected = [ref(prompt, **kw) for kw in variants]
    assert len({tuple(e) for e in expected}) == 4 and len(expected[3]) == 30
    results = run_all(lm_engine(lm_eos), [(prompt, SamplingParams(max_tokens=30, temperature=0.0, **kw))
                                          for kw in variants])
    for kw, want, events in zip(variants, expected, results, strict=True):
        assert ids_of(events) == want, kw
        assert events[-1].finish_reason == ("length" if len(want) == 30 else "stop"), kw
        text = "".join(e.text for e in events)
        assert tok.decode(prompt + want).endswith(text) and (text != "") == bool(want), kw


def test_the_kv_cache_is_sized_by_the_engine_limits(lm):
    """One cache row per running request, --max-model-len positions each, and (without --kv-cache-memory) blocks
    for every row's whole context plus the null block; a request that fills the context exactly runs to its end."""
    engine = lm_engine(lm, max_slots=3, max_model_len=40)
    cache = engine.runner.cache
    assert (cache.num_rows, engine.runner.max_len, cache.max_blocks, cache.num_blocks) == (3, 40, 3, 1 + 3 * 3)
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=2)[0])
    [events] = run_all(engine, [(prompt, SamplingParams(max_tokens=40 - len(prompt), temperature=0.0, ignore_eos=True))])
    assert len(ids_of(events)) == 40 - len(prompt) and events[-1].finish_reason == "length"


def test_a_request_that_times_out_while_queued_is_told_so(lm):
    engine = slow_steps(lm_engine(lm, max_slots=1), 0.01)

    async def run() -> None:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        first = engine.submit(lm.tokenizer.encode("a"), params)
        assert (await first.events.get()).token_ids  # holds the only slot
        queued = engine.submit(lm.tokenizer.encode("b"), params)
        queued.deadline = time.perf_counter()  # as if it had waited out its timeout
        with pytest.raises(RequestTimeout, match="queued"):
            await asyncio.wait_for(events_of(engine, queued), 10)
        for _ in range(200):  # its error is sent before the worker takes it off the queue
            if engine.queue_depth == 0:
                break
            await asyncio.sleep(0.005)
        assert engine.queue_depth == 0 and engine.running == [first]
        first.cancel()

    try:
        asyncio.run(run())
    finally:
        engine.stop()


def test_translation_finish_reasons(mt):
    """"stop" when the output ends with eos, "length" when max_tokens cut it; greedy and beams alike."""
    engine = TranslationEngine("mt", mt, max_rows=12, max_queue=32, timeout_s=60.0, metrics=Metrics())
    engine.start()
    eos = mt.config.eos_token_id
    jobs = [engine.translator.job(t, num_beams=b, max_tokens=n)
            for t in lexicon_sentences(3, seed=11, min_words=3, max_words=6) for b in (1, 2) for n in (2, 40)]
    for job, events in zip(jobs, run_all(engine, jobs), strict=True):
        ids = ids_of(events)
        reason = events[-1].finish_reason
        if job.max_new_tokens == 2:
            assert reason == "length" and len(ids) == 2 and ids[-1] != eos, (job, ids)
        else:
            assert reason == "stop" and ids[-1] == eos and eos not in ids[:-1] and len(ids) > 2, (job, ids)


@pytest.mark.parametrize("early_stopping", [True, "never"])
@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
def test_beam_searches_advanced_together_equal_each_alone_for_each_stopping_rule(early_stopping, length_penalty):
    V, width = 11, 20
    settings = [BeamSettings(num_beams=3, max_new_tokens=m, eos_token_id=2, length_penalty=length_penalty,
                             early_stopping=early_stopping) for m in (6, 12, 3, 9)]
    g = torch.Generator().manual_seed(1)
    steps = [torch.log_softmax(torch.randn(len(settings), 3, V, generator=g) * 2, -1) for _ in range(14)]
    alone = []
    for i, st in enumerate(settings):
        search, k = BeamSearch(st, 1, width=width), 0
        while not search.done:
            search.advance(steps[k][i])
            k += 1
        alone.append((search.best(), search.best_score, k))
    together, k = [BeamSearch(st, 1, width=width) for st in settings], 0
    taken = [0] * len(settings)
    while any(not s.done for s in together):
        live = [i for i, s in enumerate(together) if not s.done]
        BeamSearch.advance_many([together[i] for i in live], steps[k][live].reshape(-1, V))
        for i in live:
            taken[i] += 1
        k += 1
    assert [(s.best(), s.best_score, n) for s, n in zip(together, taken, strict=True)] == alone
    assert len({tuple(b) for b, _, _ in alone}) > 1 and len({n for _, _, n in alone}) > 1


def test_beam_search_with_one_beam_is_greedy():
    t0, t1, t2, eos = range(4)
    steps = torch.tensor([[0.1, 0.2, 0.6, 0.1], [0.1, 0.5, 0.1, 0.3], [0.2, 0.1, 0.1, 0.6]]).log()
    search, k = BeamSearch(BeamSettings(num_beams=1, max_new_tokens=10, eos_token_id=eos), t0), 0
    while not search.done:
        search.advance(steps[k][None])
        k += 1
    assert search.best() == [t2, t1, eos] and k == 3
    for bad in ({"num_beams": 0}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            BeamSearch(BeamSettings(**bad), t0)


def test_a_fault_in_one_beam_group_fails_that_group_alone(mt, monkeypatch):
    """Requests whose beams advance together (one group) fail together when that step fails; the greedy
    requests and the other group, advanced in the same step, go on unharmed."""
    engine = TranslationEngine("mt", mt, max_rows=16, max_queue=32, timeout_s=60.0, metrics=Metrics())
    texts = lexicon_sentences(2, seed=13, min_words=3, max_words=6)
    # Submitted in this order, the 2-beam group gets the lower rows and advances before the 4-beam one.
    jobs = [engine.translator.job(t, num_beams=b, max_tokens=12) for b in (2, 1, 4) for t in texts]
    expected = [job_tokens(mt, j) for j in jobs]
    original = BeamSearch.advance_top  # what a beam step calls (its rows' best tokens)

    def flaky(searches, row_scores, row_tokens):  # noqa: ANN001, ANN202
        if searches[0].s.num_beams == 4 and searches[0].step_index == 2:
            raise RuntimeError("injected fault")
        return original(searches, row_scores, row_tokens)

    monkeypatch.setattr(BeamSearch, "advance_top", staticmethod(flaky))
    engine.start()
    results = run_all(engine, jobs)
    for job, want, got in zip(jobs, expected, results, strict=True):
        if job.num_beams == 4:
            assert isinstance(got, RuntimeError) and str(got) == "generation failed: RuntimeError", got
        else:
            assert ids_of(got) == want, job
    assert engine.rows_in_use == 0 and engine.runner.cross_slots_held == 0


def test_beam_search_keeps_going_while_a_running_beam_can_still_win():
    """early_stopping=False: once num_beams hypotheses are finished, the search stops only when the best
    running beam, scored at its current length, cannot beat the worst finished one. Here after step 2 the
    finished ones score -0.916 and -0.983, the best running beam -1.155 / 2 = -0.578: it goes on, and ends
    as the best hypothesis (score -1.206 / 3) at step 3."""
    t0, t1, t2, eos = range(4)

    def step(*rows: list[float]) -> torch.Tensor:
        return torch.tensor(rows).log()

    steps = [
        step([0.05, 0.35, 0.2, 0.4], [0.25] * 4),  # beam 0 (the only live one): eos now, or t1, or t2
        step([0.005, 0.9, 0.015, 0.08], [0.025, 0.025, 0.25, 0.7]),  # [t1] goes on, [t2] ends
        step([0.02, 0.02, 0.01, 0.95], [0.4, 0.3, 0.2, 0.1]),  # [t1, t1] ends
    ]
    search = BeamSearch(BeamSettings(num_beams=2, max_new_tokens=10, eos_token_id=eos, length_penalty=1.0,
                                     early_stopping=False), t0)
    taken = 0
    while not search.done:
        search.advance(steps[taken])
        taken += 1
    assert taken == 3
    assert search.best() == [t1, t1, eos]
    assert math.isclose(search.best_score, (math.log(0.35) + math.log(0.9) + math.log(0.95)) / 3, rel_tol=1e-5)


def test_batcher_stop_finishes_the_queued_items():
    batcher = DynamicBatcher("b", lambda items: (time.sleep(0.05), [x * 2 for x in items])[1], max_batch_size=1,
                             max_wait_ms=0, max_queue=16, metrics=Metrics())
    batcher.start()

    async def run() -> list[int]:
        pending = batcher.enqueue([1, 2, 3, 4])
        await asyncio.to_thread(batcher.stop, drain_timeout_s=10)
        return await asyncio.wait_for(asyncio.gather(*(batcher.result(p) for p in pending)), 1)

    assert asyncio.run(run()) == [2, 4, 6, 8]


def test_batcher_goes_on_after_a_batch_whose_items_were_all_cancelled():
    batcher = DynamicBatcher("b", lambda items: [x * 2 for x in items], max_batch_size=4, max_wait_ms=1,
                             max_queue=16, metrics=Metrics())

    async def run() -> int:
        gone = asyncio.create_task(batcher.submit(1))
        await until(lambda: batcher.queue_depth == 1)  # queued: the batcher has not started yet
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        batcher.start()
        for _ in range(200):  # the batcher takes the batch of the one cancelled item: nothing to run
            if batcher.queue_depth == 0:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        return await asyncio.wait_for(batcher.submit(3), 5)

    try:
        assert asyncio.run(run()) == 6
    finally:
        batcher.stop(drain_timeout_s=1)


# --------------------------------------------------------------------------------------------------
# What a client is told, and what the logs carry
# --------------------------------------------------------------------------------------------------
def test_errors_tell_the_client_what_happened(lm):
    """The messages that reach a client (HTTP error bodies) say what happened, and nothing internal."""
    oom = request_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert isinstance(oom, OutOfMemory)
    assert str(oom) == "the device is out of memory; retry later or with a smaller request"
    assert str(request_error(KeyError("secret internals"))) == "generation failed: KeyError"

    engine = slow_steps(lm_engine(lm), 0.01)

    async def run() -> None:
        req = engine.submit(lm.tokenizer.encode("a"), SamplingParams(max_tokens=100, ignore_eos=True))
        assert (await req.events.get()).token_ids
        req.deadline = time.perf_counter()  # runs past its deadline now
        with pytest.raises(RequestTimeout) as info:
            await asyncio.wait_for(events_of(engine, req), 10)
        assert str(info.value) == "request timed out"

    try:
        asyncio.run(run())
    finally:
        engine.stop()

    gate = threading.Event()
    batcher = DynamicBatcher("b", lambda items: (gate.wait(5), items)[1], max_batch_size=1, max_wait_ms=0,
                             max_queue=8, metrics=Metrics())
    batcher.start()

    async def run() -> list:
        held = batcher.enqueue([1])
        await until(lambda: batcher.running and not batcher.waiting)  # inside the batch function with item 1
        left = batcher.enqueue([2, 3])
        threading.Timer(0.3, gate.set).start()
        await asyncio.to_thread(batcher.stop, drain_timeout_s=0.1)  # the drain runs out while item 1 runs
        return await asyncio.wait_for(asyncio.gather(*(batcher.result(p) for p in held + left),
                                                     return_exceptions=True), 1)

    first, *rest = asyncio.run(run())
    assert first == 1
    assert [(type(e), str(e)) for e in rest] == [(RuntimeError, "server shutting down")] * 2


def test_failures_are_logged_with_the_model(lm, monkeypatch, caplog):
    """The structured logs of a dead step loop, a failed request and a failed batch name the model (and the
    batch size)."""
    caplog.set_level(logging.INFO)
    engine = lm_engine(lm)
    original, calls = engine.step, {"n": 0}

    def dying_step() -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise SystemError("loop crash")  # the first step: the loop restarts, the request still waits
        original()

    def hook(req) -> None:  # noqa: ANN001
        raise ValueError("injected")

    monkeypatch.setattr(engine, "step", dying_step)
    engine.fault_hook = hook
    [failed] = run_all(engine, [(lm.tokenizer.encode("x"), SamplingParams(max_tokens=4))])
    assert isinstance(failed, RuntimeError) and str(failed) == "generation failed: ValueError"
    assert engine.restarts == 1

    batcher = DynamicBatcher("vit", lambda items: 1 / 0, max_batch_size=4, max_wait_ms=20, max_queue=8,
                             metrics=Metrics())
    batcher.start()

    async def run() -> list:
        return await asyncio.wait_for(asyncio.gather(*(batcher.result(p) for p in batcher.enqueue([1, 2])),
                                                     return_exceptions=True), 5)

    try:
        assert [str(e) for e in asyncio.run(run())] == ["generation failed: ZeroDivisionError"] * 2
    finally:
        batcher.stop()
    logged = {r.getMessage(): r for r in caplog.records}
    assert logged["engine loop died; restarting it"].model == "lm"
    assert logged["request failed"].model == "lm"
    # The batch's failure, then each item's alone (a batch_fn that fails on every item).
    whole = logged["batch failed; running its items one by one"]
    assert whole.model == "vit" and whole.size == 2
    assert logged["batch failed"].model == "vit" and logged["batch failed"].size == 1
