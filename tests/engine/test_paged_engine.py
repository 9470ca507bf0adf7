"""The generation engine on the block pool: outputs with the prefix cache on equal outputs with it off, requests
preempted by a small pool finish with the tokens they have alone, and after a soak of requests (some
cancelled) every block is back in the pool. The language model's tests run on each way it is loaded
(`factories.LM_LOADS`: its layers' own steps, and the fused step `tserve serve` runs on a CPU, float32 and Q4_0):
the fused step reads the pool through the rows' block tables, whose rows are the engine's slots, not the batch's."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, cycle_prompts
from tests.helpers.one_request import lm_tokens
from tests.helpers.sampling_options import option_matrix, streamed
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams, Speculation
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module", params=list(factories.LM_LOADS))
def lm(request, tmp_path_factory):
    return factories.tiny_lm_loaded(tmp_path_factory.mktemp("paged-engine"), request.param)


def engine_of(lm, **kw) -> GenerationEngine:  # noqa: ANN001
    engine = GenerationEngine("lm", lm, metrics=Metrics(), **({"max_slots": 8, "max_queue": 64, "max_model_len": 128,
                                                             "timeout_s": 120.0, "kv_block_size": 4} | kw))
    engine.start()
    return engine


def run_all(engine: GenerationEngine, jobs: list[tuple[list[int], SamplingParams]], stop: bool = True) -> list:
    """Every job submitted at once; each request (its tokens in `generated`) once all have finished."""
    async def run() -> list:
        reqs = [engine.submit(*j) for j in jobs]
        for r in reqs:
            async for _ in engine.stream(r):
                pass
        return reqs

    try:
        return asyncio.run(run())
    finally:
        if stop:
            engine.stop()


def metric(engine: GenerationEngine, name: str) -> float:
    text = engine.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def shared_prompt_jobs(lm, n: int) -> list[tuple[list[int], SamplingParams]]:  # noqa: ANN001
    """`n` prompts behind one long shared system prompt, greedy and seeded sampling alternating."""
    system = lm.tokenizer.encode(cycle_prompts(1, seed=21, min_words=10, max_words=10)[0])
    tails = cycle_prompts(n, seed=22)
    return [(system + lm.tokenizer.encode(" " + t, add_special_tokens=False),
             SamplingParams(max_tokens=12, temperature=0.0 if i % 2 == 0 else 0.9, seed=i, ignore_eos=True))
            for i, t in enumerate(tails)]


def test_outputs_with_the_prefix_cache_equal_outputs_without(lm):
    """16 requests sharing a system prompt, sent at once and then again: the same tokens with the cache on and
    off, the second round served from cached blocks (hits, cached tokens in the metrics and on each request)."""
    jobs = shared_prompt_jobs(lm, 16)
    on = engine_of(lm)
    first = run_all(on, jobs, stop=False)
    second = run_all(on, jobs)
    off = engine_of(lm, prefix_caching=False)
    plain = run_all(off, jobs)
    assert_varied([r.generated for r in plain], 0.5)
    assert [r.generated for r in first] == [r.generated for r in second] == [r.generated for r in plain]
    assert [r.cached_tokens for r in second] == [(len(p) - 1) // 4 * 4 for p, _ in jobs]  # all but the last token
    # The first round's last 8 waited for a row: by then the system prompt was cached.
    assert all(0 < r.cached_tokens < len(p) - 4 for r, (p, _) in zip(first[8:], jobs[8:], strict=True))
    assert all(r.cached_tokens == 0 for r in plain)
    hits = sum(r.cached_tokens > 0 for r in first + second)
    assert metric(on, "tserve_prefix_cache_hits_total") == hits >= 24
    assert metric(on, "tserve_prefix_cache_misses_total") == 32 - hits
    assert metric(on, "tserve_prefix_cache_cached_tokens_total") == sum(r.cached_tokens for r in first + second)
    assert metric(off, "tserve_prefix_cache_hits_total") == 0
    assert on.runner.blocks.num_in_use == 0


def test_requests_preempted_by_a_small_pool_finish_as_they_would_alone(lm):
    """Six requests of 30 new tokens in a pool of 24 blocks of 4 (each needs about 13): the newest are preempted
    and recomputed, and every one ends with the tokens it has alone, greedy and sampled."""
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(6, seed=23)]
    jobs = [(p, SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    block_bytes = 4 * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    engine = engine_of(lm, max_slots=6, kv_cache_budget=(24 * block_bytes, None), max_model_len=96)
    assert engine.runner.blocks.num_usable == 24
    reqs = run_all(engine, jobs)
    assert metric(engine, "tserve_preemptions_total") > 0
    assert_varied([r.generated for r in reqs], 0.8)
    for (p, params), req in zip(jobs, reqs, strict=True):
        assert req.generated == lm_tokens(lm, p, params)
    assert engine.runner.blocks.num_in_use == 0


def test_every_sampling_and_stopping_option_gives_the_same_from_cached_blocks_and_when_preempted(lm):
    """Each option of the API (`sampling_options.option_matrix`), behind a shared system prompt, all in one
    batch: with the prefix cache off, on (the second round read from cached blocks) and in a pool so small that
    requests are preempted and recomputed, the same tokens and text (the contract of both)."""
    system = lm.tokenizer.encode(cycle_prompts(1, seed=25, min_words=10, max_words=10)[0])
    prompts = [system + lm.tokenizer.encode(" " + t, add_special_tokens=False) for t in cycle_prompts(2, seed=26)]
    options = option_matrix(lm)
    jobs = [(p, sp) for sp in options.values() for p in prompts]
    plain = streamed(engine_of(lm, prefix_caching=False), jobs)
    cached = engine_of(lm)
    first, second = streamed(cached, jobs, stop=False), streamed(cached, jobs)
    block_bytes = 4 * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    small = engine_of(lm, max_slots=6, kv_cache_budget=(40 * block_bytes, None), max_model_len=96)
    preempted = streamed(small, jobs)
    for k, name in enumerate(options):
        rows = slice(k * len(prompts), (k + 1) * len(prompts))
        assert first[rows] == second[rows] == preempted[rows] == plain[rows], name
    assert len({tuple(ids) for ids, _ in plain}) > len(plain) * 0.6  # the options change what is written
    assert metric(cached, "tserve_prefix_cache_hits_total") >= len(jobs)  # the second round, at least
    assert metric(small, "tserve_preemptions_total") > 0
    assert cached.runner.blocks.num_in_use == small.runner.blocks.num_in_use == 0


def test_a_sliding_window_model_from_cached_blocks_and_preempted_writes_what_it_writes_alone(tmp_path):
    """Gemma 3 (its first layer attends within 16 positions, with a rope base of its own, in a pool of its own
    where a request holds only its window's blocks; prompts of 37+ tokens): requests behind a shared system prompt,
    sent twice to a prefix-caching engine (the second round from cached blocks) and once to a pool so small that
    they are preempted and recomputed, each write what it writes alone, and both pools get every block back."""
    gemma = checkpoint.load(factories.hf_family_dir("gemma3", tmp_path / "gemma3"), device="cpu")
    assert gemma.config.sliding_layers == [0] and gemma.config.sliding_window == 16
    jobs = shared_prompt_jobs(gemma, 6)
    assert min(len(p) for p, _ in jobs) > 2 * gemma.config.sliding_window
    cached = engine_of(gemma, max_slots=6)
    first, second = run_all(cached, jobs, stop=False), run_all(cached, jobs)
    block_bytes = 4 * 2 * gemma.config.n_layers * gemma.config.kv_heads * gemma.config.d_head * 4
    small = engine_of(gemma, max_slots=6, kv_cache_budget=(48 * block_bytes, None), max_model_len=96)
    # The sliding layer's own pool (every row's window and one context) is paid first, the global layer's gets
    # the rest: the two together the budget (give or take a null block).
    assert small.runner.windows.pool.num_blocks == 1 + 6 * (16 // 4 + 1) + 96 // 4
    assert abs(small.runner.cache.nbytes() - 48 * block_bytes) <= block_bytes // 2
    preempted = run_all(small, jobs)
    alone = [lm_tokens(gemma, p, params) for p, params in jobs]
    assert_varied(alone, 0.5)
    assert [r.generated for r in first] == [r.generated for r in second] == [r.generated for r in preempted] == alone
    assert sum(r.cached_tokens for r in second) > 0 and metric(small, "tserve_preemptions_total") > 0
    assert cached.runner.windows.pool.num_in_use == small.runner.windows.pool.num_in_use == 0


def test_a_sliding_window_model_with_speculative_steps_in_a_small_pool_writes_what_it_writes_alone(tmp_path):
    """Gemma 3's sliding layer in its own pool, combined: prompt-lookup drafts of 4 tokens (a step writes 5
    positions past the window's start), prefix caching and a global pool so small that requests are preempted;
    each request writes what it writes alone, and both pools get every block back."""
    gemma = checkpoint.load(factories.hf_family_dir("gemma3", tmp_path / "gemma3"), device="cpu")
    jobs = shared_prompt_jobs(gemma, 6)
    block_bytes = 4 * 2 * gemma.config.n_layers * gemma.config.kv_heads * gemma.config.d_head * 4
    engine = engine_of(gemma, max_slots=6, kv_cache_budget=(48 * block_bytes, None), max_model_len=96,
                       speculation=Speculation(num_tokens=4, max_rows=6))
    reqs = run_all(engine, jobs)
    assert [r.generated for r in reqs] == [lm_tokens(gemma, p, params) for p, params in jobs]
    assert metric(engine, "tserve_preemptions_total") > 0 and engine._drafted > 0
    assert engine.runner.windows.pool.num_in_use == engine.runner.blocks.num_in_use == 0


def test_a_soak_of_requests_gives_every_block_back(lm):
    """120 requests (shared prefixes, some cancelled while running, some while queued) through a pool that
    preempts: at the end no block is held, every count is zero, and the cached names fit in the pool."""
    rng = random.Random(5)
    prefixes = [lm.tokenizer.encode(t) for t in cycle_prompts(4, seed=24, min_words=8, max_words=12)]
    block_bytes = 4 * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    engine = engine_of(lm, max_slots=8, kv_cache_budget=(40 * block_bytes, None), max_queue=200)

    async def run() -> None:
        reqs = []
        for i in range(120):
            ids = rng.choice(prefixes) + [rng.randrange(5, 60) for _ in range(rng.randrange(1, 6))]
            reqs.append(engine.submit(ids, SamplingParams(max_tokens=rng.randrange(1, 20), temperature=1.0, seed=i)))
        for i, r in enumerate(reqs):
            if i % 11 == 5:
                r.cancel()  # gone while queued
        await asyncio.gather(*(drain(r, leave_early=i % 7 == 3) for i, r in enumerate(reqs) if i % 11 != 5))

    async def drain(req, leave_early: bool) -> None:  # noqa: ANN001
        async for _ in engine.stream(req):
            if leave_early:
                break  # the client leaves after its first token: the stream cancels the request

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    pool = engine.runner.blocks
    assert pool.num_in_use == 0 and pool.num_free == pool.num_usable
    assert all(pool.refs(b) == 0 for b in range(pool.num_blocks))
    assert len(pool._by_name) <= pool.num_usable and engine.runner.slots.num_used == 0
    assert metric(engine, "tserve_prefix_cache_hits_total") > 0


# --------------------------------------------------------------------------------------------------
# Translators: an identical source's encoder output is reused
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("paged-mt")), device="cpu")


def counting_encoder(runner, monkeypatch) -> list[int]:  # noqa: ANN001
    """The batch sizes the runner's encoder runs at, recorded."""
    batches: list[int] = []
    start = runner.model.start
    monkeypatch.setattr(runner.model, "start", lambda src, *a, **k: (batches.append(len(src)), start(src, *a, **k)))
    return batches


def test_an_identical_source_reads_the_encoder_output_of_the_first(mt, monkeypatch):
    """Sources repeated across batches (a document's header, a UI string) are encoded once: later copies (greedy
    or beams) read the first one's cross slot, and every translation equals its source translated alone. Two
    different sources of the same length never share; with reuse off everything is encoded; a slot no one reads
    gives way to a new source when none is free."""
    from tests.helpers.fixture_training import lexicon_sentences
    from tests.helpers.one_request import mt_tokens
    from tserve.model.decoding import Seq2SeqRunner, translation_job
    from tserve.model.decoding.seq2seq_runner import run_jobs

    texts = lexicon_sentences(40, seed=8, min_words=4, max_words=4)
    encode = mt.tokenizer.encode
    a, b = next((a, b) for a in texts for b in texts if a != b and len(encode(a)) == len(encode(b)))
    c = next(t for t in texts if t not in (a, b))
    batches = [[(a, 1), (b, 1)], [(a, 4), (b, 1)], [(a, 1), (c, 1)]]
    alone = {(t, n): mt_tokens(mt, encode(t), n) for batch in batches for t, n in batch}  # before counting
    for reuse, encoded in ((True, 3), (False, 6)):
        runner = Seq2SeqRunner(mt, num_rows=5, cuda_graphs=False, reuse_sources=reuse)
        encoder = counting_encoder(runner, monkeypatch)
        for batch in batches:
            jobs = [translation_job(mt, encode(t), num_beams=n) for t, n in batch]
            outputs = [r.output_ids for r in run_jobs(mt, jobs, runner=runner)]
            assert outputs == [alone[key] for key in batch]
        assert sum(encoder) == encoded and runner.cross_slots_held == 0 and runner.blocks_in_use == 0
        assert runner.blocks.num_in_use == runner.blocks_kept if reuse else runner.blocks.num_in_use == 0
        monkeypatch.undo()
    runner = Seq2SeqRunner(mt, num_rows=1, cuda_graphs=False)
    encoder = counting_encoder(runner, monkeypatch)
    for t in (a, b, b, a):  # one slot: b takes a's, a takes b's back
        run_jobs(mt, [translation_job(mt, encode(t), num_beams=1)], runner=runner)
    assert sum(encoder) == 3


def test_the_engine_counts_encoder_outputs_reused(mt):
    from tests.helpers.fixture_training import lexicon_sentences
    from tserve.model.decoding import translation_job
    from tserve.service.engine import TranslationEngine

    engine = TranslationEngine("mt", mt, max_rows=4, max_queue=16, timeout_s=60.0, metrics=Metrics())
    engine.start()
    source = mt.tokenizer.encode(lexicon_sentences(1, seed=9)[0])

    async def run() -> list:
        outs = []
        for _ in range(3):
            req = engine.submit(translation_job(mt, source, num_beams=1))
            outs.append([t for e in [e async for e in engine.stream(req)] for t in e.token_ids])
        return outs

    try:
        first, *again = asyncio.run(run())
    finally:
        engine.stop()
    assert first and all(o == first for o in again)
    assert metric(engine, "tserve_encoder_cache_hits_total") == 2


def test_each_request_counts_one_first_token_and_a_gap_before_each_later_one(lm):
    """The latency metrics and each request's timeline (what a trace's prefill and decode spans are cut from): one
    time to first token a request, one inter-token gap for each token after its first; the first token between
    the request's admission and its end."""
    jobs = [(lm.tokenizer.encode(t), SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True))
            for i, t in enumerate(cycle_prompts(3, seed=51))]
    engine = engine_of(lm)
    reqs = run_all(engine, jobs)
    assert metric(engine, "tserve_time_to_first_token_seconds_count") == len(jobs)
    assert metric(engine, "tserve_inter_token_latency_seconds_count") == sum(len(r.generated) - 1 for r in reqs) > 0
    for r in reqs:
        assert 0 < r.admitted_ns <= r.first_token_ns <= r.finished_ns, r
