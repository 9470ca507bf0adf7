"""Asynchronous scheduling of the translation engine: greedy rows' steps are launched before their last tokens
are read (beam groups advance on the host at once), and the streams equal the synchronous engine's, event for
event, with beams, glossary terms and preemption beside them."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, lexicon_sentences
from tests.helpers.one_request import job_tokens
from tserve.model.decoding.seq2seq_runner import run_jobs
from tserve.service.engine import TranslationEngine
from tserve.service.engine.kv_memory import kv_block_bytes
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BLOCK = 4


@pytest.fixture(scope="module", params=list(factories.MT_LOADS))
def mt(request, tmp_path_factory):
    """The tiny translator as each of `factories.MT_LOADS` loads it (the server's pre-packed weights, int8)."""
    return factories.tiny_mt_loaded(tmp_path_factory.mktemp("mt-async"), request.param)


def engine_of(mt, mode: str, blocks: int | None = None) -> TranslationEngine:  # noqa: ANN001
    budget = (None if blocks is None else blocks * kv_block_bytes(mt, BLOCK), None)
    engine = TranslationEngine("mt", mt, max_rows=16, max_queue=100, timeout_s=120, metrics=Metrics(),
                               kv_cache_budget=budget, kv_block_size=BLOCK, async_scheduling=mode)
    engine.start()
    return engine


def counting_rows(engine: TranslationEngine) -> list[tuple[int, bool]]:
    """Rows of each decoder step the engine launches, and whether tokens were on their way then."""
    launched = []
    decode = engine.runner.decode

    def counted(seqs):  # noqa: ANN001, ANN202
        launched.append((sum(len(s.rows) for s in seqs), bool(engine._in_flight)))
        return decode(seqs)

    engine.runner.decode = counted
    return launched


def streams(engine: TranslationEngine, jobs: list) -> list[list[tuple]]:
    """Every job at once; each request's events (text, ids, finish reason, hypotheses with their scores)."""
    async def one(req) -> list[tuple]:  # noqa: ANN001
        out = []
        async for e in engine.stream(req):
            hyps = [(h.text, h.token_ids, round(h.score, 4)) for h in e.result] if e.result else None
            out.append((e.text, e.token_ids, e.finish_reason, hyps))
        return out

    async def run() -> list:
        return await asyncio.gather(*(one(engine.submit(j)) for j in jobs))

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def jobs_of(mt, engine: TranslationEngine, n: int, beams: tuple[int, ...], max_tokens=lambda i: 40) -> list:  # noqa: ANN001
    texts = lexicon_sentences(n, seed=41, min_words=4, max_words=14)
    return [engine.translator.job(t, num_beams=beams[i % len(beams)], max_tokens=max_tokens(i))
            for i, t in enumerate(texts)]


def test_greedy_beams_glossary_and_preemption_stream_what_the_synchronous_engine_streams(mt):
    """18 requests, greedy, 2 and 4 beams, two with a glossary term, on a pool small enough to preempt: the
    overlapped engine's events are the synchronous one's, its greedy steps were launched with tokens unread,
    and every row and block comes back."""
    reference = engine_of(mt, "off", blocks=60)
    jobs = jobs_of(mt, reference, 18, (1, 1, 4, 1, 2), lambda i: 10 + (i * 7) % 30)
    for job in jobs[2:12:5]:  # 4-beam jobs with a glossary term
        first = job_tokens(mt, job)[0]
        job.constraints, job.constraint_terms = [[first]], [mt.tokenizer.decode([first]).strip()]
    expected = streams(reference, jobs)
    assert_varied([s[-1][3][0][1] for s in expected])
    greedy = [j for j in jobs if j.num_beams == 1]  # their scores, read from the device with their tokens
    alone = [s.logprob_sum / len(s.generated) ** mt.generation.length_penalty for s in run_jobs(mt, greedy)]
    # int8: the same tokens as alone, but a row's score moves by up to ~2e-3 with the batch it ran in (its activations
    # are coded per row; where float32 sums before a product differ in their last bits with the batch's shapes, a
    # value on a code's boundary takes the next code).
    tolerance = 5e-3 if mt.quantization == "int8" else 1e-3
    assert [s[-1][3][0][2] for s, j in zip(expected, jobs, strict=True) if j.num_beams == 1] == pytest.approx(
        alone, abs=tolerance)
    overlapped = engine_of(mt, "on", blocks=60)
    launched = counting_rows(overlapped)
    assert streams(overlapped, jobs) == expected
    assert overlapped.m.preemptions._value.get() > 0
    assert any(unread for _, unread in launched)
    assert overlapped.rows_in_use == 0 and overlapped.runner.blocks_in_use == 0


def test_a_greedy_row_ended_by_max_tokens_is_not_stepped_again_and_one_ended_by_eos_is_once(mt):
    """Decoder rows launched for greedy translations: ended by max_tokens (known on the host), as many as the
    synchronous engine's; ended by eos (known once read), one more each, whose token reaches no stream."""
    rows, out = {}, {}
    for mode in ("off", "on"):
        for name, limit in (("length", lambda i: 3 + i % 4), ("eos", lambda i: 60)):
            engine = engine_of(mt, mode)
            jobs = jobs_of(mt, engine, 8, (1,), limit)
            launched = counting_rows(engine)
            out[mode, name] = streams(engine, jobs)
            rows[mode, name] = sum(n for n, _ in launched)
    assert out["on", "length"] == out["off", "length"]
    assert all(s[-1][2] == "length" for s in out["off", "length"])
    assert rows["on", "length"] == rows["off", "length"]
    assert out["on", "eos"] == out["off", "eos"]
    assert all(s[-1][2] == "stop" for s in out["off", "eos"])
    assert rows["on", "eos"] == rows["off", "eos"] + 8
