"""A document's sentences in the translation engine: they decode side by side as rows of one running batch,
count once toward --max-queue, and take turns with other requests, so that a short request sent while a long
document runs finishes first. Each sentence gives exactly what it gives alone."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import lexicon_sentences
from tests.helpers.one_request import job_tokens
from tserve.model import checkpoint
from tserve.service.engine import QueueFull, TranslationEngine
from tserve.service.metrics import Metrics
from tserve.service.translation.served import collect_translation

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("mt")), device="cpu")


def _document(engine: TranslationEngine, sentences: int, max_tokens: int = 12):
    text = "\n".join(lexicon_sentences(sentences, seed=3, min_words=3, max_words=6))
    doc = engine.translator.document(text, num_beams=1, max_tokens=max_tokens)
    assert len(doc.jobs) == sentences
    return doc


def test_a_documents_sentences_decode_together_and_each_as_alone(mt):
    engine = TranslationEngine("mt", mt, max_rows=8, max_queue=4, timeout_s=60, metrics=Metrics())
    doc = _document(engine, 6)
    batch_rows: list[int] = []
    decode = engine.runner.decode
    engine.runner.decode = lambda seqs: (batch_rows.append(len(seqs)), decode(seqs))[1]
    engine.start()

    async def run() -> list:
        reqs = engine.submit_all(doc.jobs, one_request=True)
        return await asyncio.gather(*(collect_translation(engine, r) for r in reqs))

    try:
        results = asyncio.run(run())
    finally:
        engine.stop()
    assert max(batch_rows) == 6  # every sentence in the same decoder batch
    for job, result in zip(doc.jobs, results, strict=True):
        assert result.token_ids == job_tokens(mt, job)


def test_a_document_counts_once_toward_max_queue(mt):
    engine = TranslationEngine("mt", mt, max_rows=2, max_queue=1, timeout_s=60, metrics=Metrics())  # not started

    async def run() -> None:
        reqs = engine.submit_all(_document(engine, 10).jobs, one_request=True)
        assert len(engine.waiting) == 10 and engine.queue_depth == 1
        with pytest.raises(QueueFull):
            engine.submit(engine.translator.job("good morning", num_beams=1, max_tokens=4))
        for r in reqs:
            r.cancel()

    asyncio.run(run())


def test_a_short_request_is_not_held_back_by_a_long_document(mt):
    """16 sentences on 4 rows run in four waves; the short request sent after the document takes the first
    row that frees up (its first part competes with the document's 5th and later parts, which wait their
    turn), so it finishes before most of the document."""
    engine = TranslationEngine("mt", mt, max_rows=4, max_queue=4, timeout_s=60, metrics=Metrics())

    async def run() -> tuple:
        doc = engine.submit_all(_document(engine, 16, max_tokens=20).jobs, one_request=True)
        short = engine.submit(engine.translator.job("good morning", num_beams=1, max_tokens=20))
        engine.start()
        await asyncio.gather(*(collect_translation(engine, r) for r in doc + [short]))
        return doc, short

    try:
        doc, short = asyncio.run(run())
    finally:
        engine.stop()
    steps = sorted(r.finished_step for r in doc)
    assert short.finished_step < steps[len(steps) // 2], (short.finished_step, steps)
