"""The engine's scheduling where its options meet, in-process: asynchronous scheduling with logprobs beside a
request that eos ended one step before; preemption with the prefix cache (what usage reports as cached) and with
the queue's order (the newest running request gives way, and comes back before requests that came after it);
identical prompts sent at once (several choices of one request) reading the blocks the first computes; call jobs
with --max-queue 0; --kv-cache-memory given as a fraction of free memory for a model whose sliding-window layers
keep a pool of their own; a translator's admission beside running beams in a small pool. Each test compares
against the same requests with the other option at its default, or against what the docs promise."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.test_paged_engine import run_all
from tests.engine.test_translation_preemption import mixed_jobs, small_pool_engine, translate_all
from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts, lexicon_sentences
from tests.helpers.hooked_server import slow_steps
from tests.helpers.one_request import job_tokens
from tests.helpers.sampling_options import events
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams
from tserve.service.engine import GenerationEngine, QueueFull, kv_memory
from tserve.service.metrics import Metrics

BS = 4  # positions per KV block: a few tokens fill one


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return factories.tiny_lm_loaded(tmp_path_factory.mktemp("scheduling-lm"), "layers")


def engine_of(lm, **kw) -> GenerationEngine:  # noqa: ANN001
    engine = GenerationEngine("lm", lm, metrics=Metrics(), **({"max_slots": 8, "max_queue": 64, "max_model_len": 128,
                                                             "timeout_s": 120.0, "kv_block_size": BS} | kw))
    engine.start()
    return engine


def block_bytes(loaded) -> int:  # noqa: ANN001
    cfg = loaded.config
    return BS * 2 * cfg.n_layers * cfg.kv_heads * cfg.d_head * 4  # float32


def same_length_prompts(lm, n: int, seed: int) -> list[list[int]]:  # noqa: ANN001
    """`n` different prompts of one token length (so that requests of one max_tokens end in the order they start)."""
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(4 * n, seed=seed)]
    length = min(len(p) for p in prompts)
    prompts = [p[:length] for p in prompts]
    unique = list({tuple(p): p for p in prompts}.values())
    assert len(unique) >= n
    return unique[:n]


# --------------------------------------------------------------------------------------------------
# Asynchronous scheduling
# --------------------------------------------------------------------------------------------------
def test_logprobs_of_an_overlapped_step_stay_with_their_rows_when_an_earlier_row_ended_by_eos(lm):
    """With --async-scheduling on, a request that eos ended is stepped once more and that row dropped when the
    step is read; the rows after it in that step must keep their own logprobs. No penalties or grammar here: they
    make the engine read every token before the next step, and nothing would overlap."""
    eos = lm.tokenizer.eos_id
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(6, seed=41)]
    jobs = [(p, SamplingParams(max_tokens=16, temperature=0.0, min_tokens=1 + i, logit_bias={eos: 60.0}))
            for i, p in enumerate(prompts[:3])]  # eos after 1, 2, 3 tokens: rows dropped at three steps
    jobs += [(p, SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 1.0, seed=i, logprobs=2, ignore_eos=True))
             for i, p in enumerate(prompts[3:])]
    expected = events(engine_of(lm, async_scheduling="off"), jobs)
    got = events(engine_of(lm, async_scheduling="on"), jobs)
    assert [len(e[-1][1]) for e in expected[:3]] == [1, 2, 3]  # eos right after min_tokens
    # The overlapped engine steps the ended rows once more, so its steps' products have other row counts: the same
    # logprobs within float32 rounding (a row given another's would be off by far more), all else equal.
    assert without_logprobs(got) == without_logprobs(expected)
    for request, (mine, theirs) in enumerate(zip(logprob_values(got), logprob_values(expected), strict=True)):
        assert mine == pytest.approx(theirs, abs=1e-4), request


def without_logprobs(requests: list[list[tuple]]) -> list[list[tuple]]:
    return [[(e[0], e[1], [(lp[0], lp[2]) for lp in e[2]], e[3]) if len(e) == 4 else e for e in r] for r in requests]


def logprob_values(requests: list[list[tuple]]) -> list[list[float]]:
    return [[lp[1] for e in r if len(e) == 4 for lp in e[2]] for r in requests]


# --------------------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------------------
def test_a_preempted_request_reports_the_prompt_tokens_its_first_admission_read_from_the_cache(lm):
    """Usage's `cached_tokens` are prompt tokens read from the prefix cache. A preempted request is admitted again
    and finds its own blocks (prompt and answer) still named: that recomputation is not the client's cache hit,
    so every request reports at most its prompt, and requests with no shared prefix report nothing (in usage and
in the prefix cache's metrics)."""
    prompts = same_length_prompts(lm, 6, seed=42)
    assert len({tuple(p[:BS]) for p in prompts}) == len(prompts)  # not even a first block in common
    jobs = [(p, SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine = engine_of(lm, max_slots=6, kv_cache_budget=(24 * block_bytes(lm), None), max_model_len=96)
    reqs = run_all(engine, jobs)
    assert engine.m.preemptions._value.get() > 0
    assert [r.cached_tokens for r in reqs] == [0] * len(reqs)
    # the metrics count each client request once, as usage does: no hit, no cached token
    assert engine.m.prefix_hits._value.get() == 0 and engine.m.prefix_misses._value.get() == len(reqs)
    assert engine.m.prefix_cached_tokens._value.get() == 0


def test_the_newest_running_request_gives_way_and_comes_back_before_later_arrivals(lm):
    """A pool that runs dry preempts the newest running request (the oldest, nearest its end, keeps its blocks),
    and a preempted request goes back to the head of the queue, ahead of requests that came after it: requests of
    one length, sent in order, finish in that order however often they are preempted."""
    prompts = same_length_prompts(lm, 8, seed=43)
    jobs = [(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for p in prompts]
    engine = engine_of(lm, max_slots=6, kv_cache_budget=(24 * block_bytes(lm), None), max_model_len=96,
                       prefix_caching=False)
    victims = []
    requeue = engine._requeue_preempted

    def recorded(req, tokens: int) -> None:  # noqa: ANN001
        victims.append(req is engine.running[-1])  # the running list is in admission order
        requeue(req, tokens)

    engine._requeue_preempted = recorded
    reqs = run_all(engine, jobs)
    assert victims and all(victims)
    steps = [r.finished_step for r in reqs]
    assert steps == sorted(steps)
    assert engine.runner.blocks.num_in_use == 0


# --------------------------------------------------------------------------------------------------
# The prefix cache
# --------------------------------------------------------------------------------------------------
def test_identical_prompts_sent_at_once_compute_the_prompt_once_and_the_others_read_it(lm):
    """Several choices of one request (n > 1) are identical prompts queued together: the first computes the
    prompt's blocks, the others wait a step and read them (each reports them as cached), and all write the
    same greedy tokens as with --no-prefix-cache."""
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=44, min_words=8, max_words=8)[0])
    assert len(prompt) > 3 * BS
    jobs = [(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))] * 4
    cached = run_all(engine_of(lm), jobs)
    plain = run_all(engine_of(lm, prefix_caching=False), jobs)
    assert [r.cached_tokens for r in cached] == [0] + [(len(prompt) - 1) // BS * BS] * 3
    assert [r.generated for r in cached] == [r.generated for r in plain]
    assert all(r.cached_tokens == 0 for r in plain)


# --------------------------------------------------------------------------------------------------
# Call jobs
# --------------------------------------------------------------------------------------------------
def test_with_max_queue_0_a_call_job_is_taken_while_every_row_is_busy(lm):
    """--max-queue 0 leaves no waiting room for requests that need a row; a call job (prompt scoring for echo
    with logprobs, inspection work) holds none and runs between steps, so it is taken while the rows are busy."""
    engine = slow_steps(GenerationEngine("lm", lm, metrics=Metrics(), max_slots=1, max_queue=0, max_model_len=None,
                                         timeout_s=60.0), 0.01)
    engine.start()
    prompt = lm.tokenizer.encode("Good morning")

    async def run() -> list:
        long = engine.submit(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        while not engine.running:
            await asyncio.sleep(0.001)
        with pytest.raises(QueueFull):  # a request that needs a row is refused ...
            engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0))
        scored = await asyncio.wait_for(engine.result(engine.call(engine.score_prompt, prompt, 2)), 20)
        assert not long.finished  # ... and the call ran beside it
        async for _ in engine.stream(long):
            pass
        return scored

    try:
        scored = asyncio.run(run())
    finally:
        engine.stop()
    assert len(scored) == len(prompt) and scored[0] is None and all(s is not None for s in scored[1:])


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------
def test_a_fractional_kv_cache_budget_pays_for_the_sliding_layers_pool_as_a_byte_budget_does(tmp_path, monkeypatch):
    """--kv-cache-memory as a fraction of the free memory, for Gemma 3 (its sliding layer keeps its own pool): the
    two pools together take that fraction, exactly as the same budget given in bytes, not the fraction plus the
    sliding pool."""
    gemma = checkpoint.load(factories.hf_family_dir("gemma3", tmp_path / "gemma3"), device="cpu")
    per_block = block_bytes(gemma)
    monkeypatch.setattr(kv_memory, "free_memory", lambda device: 400 * per_block)
    by_fraction = GenerationEngine("g", gemma, metrics=Metrics(), max_slots=6, max_queue=4, max_model_len=96,
                                   timeout_s=60.0, kv_block_size=BS, kv_cache_budget=(None, 0.25))
    in_bytes = GenerationEngine("g", gemma, metrics=Metrics(), max_slots=6, max_queue=4, max_model_len=96,
                                timeout_s=60.0, kv_block_size=BS, kv_cache_budget=(100 * per_block, None))
    assert by_fraction.runner.windows is not None
    assert by_fraction.runner.blocks.num_blocks == in_bytes.runner.blocks.num_blocks
    assert abs(by_fraction.runner.cache.nbytes() - 100 * per_block) <= per_block // 2


# --------------------------------------------------------------------------------------------------
# Translation: admission beside running beams
# --------------------------------------------------------------------------------------------------
def test_a_translation_admitted_into_a_small_pool_is_not_preempted_at_the_step_that_admits_it(tmp_path):
    """Admission leaves free the blocks the running requests (greedy and beams) take at their next step: a
    request is admitted only when it can keep its blocks through that step, not admitted and preempted at once
    (which recomputes its encoder output for nothing). The pool is still small enough that requests are
    preempted later on, and each ends with the ids it gives alone."""
    mt = factories.tiny_mt_loaded(tmp_path, "packed")
    engine = small_pool_engine(mt, blocks=60)
    jobs = mixed_jobs(engine, lexicon_sentences(24, seed=5, min_words=4, max_words=14))
    at_once = []
    requeue = engine._requeue_preempted

    def recorded(req, tokens: int) -> None:  # noqa: ANN001
        at_once.append(req.admitted_step == engine.steps)
        requeue(req, tokens)

    engine._requeue_preempted = recorded
    results = translate_all(engine, jobs)
    assert at_once and not any(at_once)
    assert [r.token_ids for r in results] == [job_tokens(mt, j) for j in jobs]


def test_a_requests_choices_and_prompts_count_once_toward_max_queue(lm):
    """--max-queue counts client requests: a request's n choices (or its list of prompts) wait as one, so that
    an idle server with --max-queue 2 takes a request of 3 choices, and a third client's request is the one
    refused once two requests wait."""
    engine = GenerationEngine("lm", lm, metrics=Metrics(), max_slots=8, max_queue=2, max_model_len=128,
                              timeout_s=120.0)  # not started: what is submitted waits
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def run() -> None:
        choices = engine.submit_all([([5, 6, 7], params)] * 3)
        assert len(choices) == 3 and engine.queue_depth == 1
        engine.submit_all([([8, 9], params), ([10, 11], params)])  # a second request: two prompts
        assert engine.queue_depth == 2
        with pytest.raises(QueueFull, match="2 requests waiting"):
            engine.submit_all([([12], params)])
        for req in engine.waiting:
            req.cancel()

    asyncio.run(run())
