"""Continuous batching for translation: requests of mixed lengths and beam sizes give exactly what each
gives alone, join mid-flight without disturbing running ones, free their rows when cancelled, and keep
parity with transformers' Marian through the engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from tests.helpers import factories
from tests.helpers.beam_parity import BeamParity, hf_beam_hypotheses, spelled_otherwise
from tests.helpers.fixture_training import assert_varied, lexicon_sentences, sentences_where_beams_matter
from tests.helpers.hooked_server import slow_steps
from tests.helpers.one_request import assert_translations_as_alone, job_tokens
from tests.helpers.polling import until
from tserve.model import checkpoint
from tserve.service.engine import TranslationEngine
from tserve.service.metrics import Metrics
from tserve.service.translation.served import collect_translation

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("mt")), device="cpu")


def make_engine(loaded, max_rows: int = 12) -> TranslationEngine:
    engine = TranslationEngine("mt", loaded, max_rows=max_rows, max_queue=100, timeout_s=120, metrics=Metrics())
    engine.start()
    return engine


def alone(loaded, engine: TranslationEngine, job) -> list[int]:
    """What the one-request decoders give for this job."""
    return job_tokens(loaded, job)


@pytest.fixture(scope="module")
def mt_int8(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("mt8")), device="cpu", quantize="int8")


@pytest.fixture(scope="module")
def mt_int4(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("mt4")), device="cpu", quantize="int4")


# int8 and int4 are the long tail: each row of theirs is computed on its own (tests/model/test_quantize.py).
@pytest.mark.parametrize("quantize", ["none", pytest.param("int8", marks=pytest.mark.slow),
                                      pytest.param("int4", marks=pytest.mark.slow)])
def test_forty_mixed_requests_equal_each_alone(quantize, mt, mt_int8, mt_int4):
    """int8 too: its activations are quantized per row, so a row's numbers do not depend on its batch; int4's
    kernel computes each row on its own."""
    mt = {"none": mt, "int8": mt_int8, "int4": mt_int4}[quantize]
    engine = make_engine(mt)
    # Up to 14 words: longer than anything the lexicon model was trained on, where it is unsure and
    # beams find other answers than greedy decoding.
    texts = lexicon_sentences(40, max_words=14)
    jobs = [engine.translator.job(t, num_beams=(1, 2, 4)[i % 3], max_tokens=4 + (i * 7) % 36)
            for i, t in enumerate(texts)]
    expected = [alone(mt, engine, j) for j in jobs]
    assert_varied(expected)
    greedy = [alone(mt, engine, engine.translator.job(t, num_beams=1, max_tokens=j.max_new_tokens))
              for t, j in zip(texts, jobs, strict=True)]
    assert sum(e != g for e, g in zip(expected, greedy, strict=True)) >= 3  # the beams matter

    async def all_at_once() -> list:
        # Half now; the other half joins while the first half is decoding.
        first = [engine.submit(j) for j in jobs[:20]]
        tasks = [asyncio.create_task(collect_translation(engine, r)) for r in first]
        await asyncio.sleep(0.05)
        later = [engine.submit(j) for j in jobs[20:]]
        tasks += [asyncio.create_task(collect_translation(engine, r)) for r in later]
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(all_at_once())
    finally:
        engine.stop()
    assert_translations_as_alone(mt, jobs, results, expected)
    assert engine.rows_in_use == 0 and engine.runner.cross_slots_held == 0


def test_cancel_frees_rows(mt):
    engine = slow_steps(make_engine(mt, max_rows=4), 0.02)  # a step takes 20 ms: the cancel lands mid-search

    async def scenario() -> None:
        job = engine.translator.job("hello world good morning", num_beams=4, max_tokens=60)
        job.max_new_tokens = 60
        assert len(alone(mt, engine, job)) >= 6  # the search runs for more steps than a cancel may take
        req = engine.submit(job)
        await until(lambda: engine.rows_in_use == 4)
        req.cancel()
        cancelled_at = engine.steps
        await until(lambda: engine.rows_in_use == 0 and not engine.running)
        assert engine.steps - cancelled_at <= 2  # freed by the cancel at the next step, not by the search's end
        # The rows are usable again.
        greedy = engine.translator.job("good morning", num_beams=1, max_tokens=5)
        ids = (await collect_translation(engine, engine.submit(greedy))).token_ids
        assert ids == alone(mt, engine, greedy)

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_too_many_beams_is_refused(mt):
    engine = make_engine(mt, max_rows=2)

    async def scenario() -> None:
        with pytest.raises(ValueError, match="num_beams"):
            engine.submit(engine.translator.job("hello", num_beams=4, max_tokens=4))

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_marian_parity_through_the_engine(hf_marian):
    """Greedy and 4-beam requests all at once through the engine answer what `generate` answers, ids and
    score, including sources whose best hypothesis spells its text with other tokens than the text encodes
    to (the engine returns beam search's first hypothesis as generated, never a re-ranked one)."""
    ours = checkpoint.load(hf_marian, device="cpu")
    hf = transformers.MarianMTModel.from_pretrained(hf_marian).eval()
    pad, eos = ours.config.pad_token_id, ours.config.eos_token_id
    reference = {}
    for text in lexicon_sentences(30, seed=11, min_words=2, max_words=10):
        reference[text] = hf_beam_hypotheses(hf, ours.tokenizer.encode(text), 4, 20, pad)
    respelled = [t for t, ref in reference.items() if spelled_otherwise(ours.tokenizer, ref[0][0], eos)][:3]
    assert len(respelled) == 3, "the fixture's beams no longer spell any text otherwise: the test lost its point"
    sentences = [*respelled, *sentences_where_beams_matter(ours, 2, max_new_tokens=20),
                 *lexicon_sentences(2, seed=7, max_words=6)]
    engine = make_engine(ours, max_rows=16)
    jobs = [engine.translator.job(s, num_beams=b, max_tokens=20) for s in sentences for b in (1, 4)]

    async def all_at_once() -> list:
        reqs = [engine.submit(j) for j in jobs]
        return await asyncio.gather(*(collect_translation(engine, r) for r in reqs))

    try:
        results = asyncio.run(all_at_once())
    finally:
        engine.stop()
    parity = BeamParity()
    for text, job, result in zip([s for s in sentences for _ in (1, 4)], jobs, results, strict=True):
        if job.num_beams == 1:
            with torch.no_grad():
                ref = hf.generate(torch.tensor([job.source_ids]), num_beams=1, do_sample=False, max_new_tokens=20)
            assert result.token_ids == [t for t in ref[0, 1:].tolist() if t != pad], text
            continue
        ref = reference.get(text) or hf_beam_hypotheses(hf, job.source_ids, 4, 20, pad)
        parity.check(result.token_ids, result.hypotheses[0].score, ref, text)
        assert result.text == ours.tokenizer.decode(result.token_ids)
    parity.assert_at_most_one_tie()


def test_max_model_len_sizes_a_translators_cache_and_limits(tmp_path):
    """--max-model-len caps a translator's source tokens and target positions, each: the cache holds that
    many per row, a longer sentence is cut into segments that fit, and max_tokens above it is refused."""
    nllb = checkpoint.load(factories.hf_nllb_dir(tmp_path / "nllb"))
    assert nllb.config.max_source_len == nllb.config.max_target_len == 64
    full = TranslationEngine("nllb", nllb, max_rows=2, max_queue=4, timeout_s=60.0, metrics=Metrics())
    capped = TranslationEngine("nllb", nllb, max_rows=2, max_queue=4, timeout_s=60.0, metrics=Metrics(), max_len=8)
    assert full.runner.max_target_len == 64 and capped.runner.max_target_len == 8
    assert capped.runner.cache.cross_kv.max_len == 8
    # Blocks of 16 positions for each of the 2 rows' whole target length and a whole source, and the null block.
    assert full.runner.cache.self_kv.num_blocks == 1 + 2 * (4 + 4)
    assert capped.runner.cache.self_kv.num_blocks == 1 + 2 * (1 + 1)
    languages = ("eng_Latn", "deu_Latn")
    text = "the quick brown fox jumps over the lazy dog and the king"
    assert len(capped.translator.encode_source(text, languages)) > 8
    doc = capped.translator.document(text, None, None, None, languages)
    assert len(doc.jobs) > 1 and all(len(j.source_ids) <= 8 and j.max_new_tokens <= 8 for j in doc.jobs)
    assert len(full.translator.document(text, None, None, None, languages).jobs) == 1
    from tserve.service.settings import Settings
    from tserve.service.translation.inputs import TranslationAsk, check_options

    check_options(TranslationAsk([text], max_tokens=8), Settings(), capped.translator.max_target_len, 4)
    with pytest.raises(ValueError, match="exceeds this model's limit of 8"):
        check_options(TranslationAsk([text], max_tokens=9), Settings(), capped.translator.max_target_len, 4)
