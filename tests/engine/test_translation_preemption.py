"""A translator's decoder cache sized by memory (`--kv-cache-memory`): requests are admitted with the blocks of
their first position, and when the pool runs dry the newest are preempted, replay their positions when admitted
again, and finish with exactly the tokens they give alone; a greedy stream repeats nothing."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, lexicon_sentences
from tests.helpers.one_request import assert_translations_as_alone, job_tokens
from tserve.model import checkpoint
from tserve.service.engine import TranslationEngine
from tserve.service.engine.kv_memory import kv_block_bytes
from tserve.service.metrics import Metrics
from tserve.service.translation.served import collect_translation

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BLOCK = 4  # positions per block: outputs of 10-40 tokens cross several blocks


@pytest.fixture(scope="module", params=list(factories.MT_LOADS))
def mt(request, tmp_path_factory):
    """The tiny translator as each of `factories.MT_LOADS` loads it (the server's pre-packed weights, int8)."""
    return factories.tiny_mt_loaded(tmp_path_factory.mktemp("mt"), request.param)


def small_pool_engine(loaded, blocks: int, max_rows: int = 16) -> TranslationEngine:
    budget = blocks * kv_block_bytes(loaded, BLOCK)
    engine = TranslationEngine("mt", loaded, max_rows=max_rows, max_queue=100, timeout_s=120, metrics=Metrics(),
                               kv_cache_budget=(budget, None), kv_block_size=BLOCK)
    engine.start()
    return engine


def mixed_jobs(engine: TranslationEngine, texts: list[str]) -> list:
    """Greedy, 4-beam and 2-beam jobs in turn, of max_tokens from 12 to 37: rows of many lengths and widths."""
    return [engine.translator.job(t, num_beams=(1, 4, 2)[i % 3], max_tokens=12 + (i * 5) % 28)
            for i, t in enumerate(texts)]


def translate_all(engine: TranslationEngine, jobs: list) -> list:
    """Every job submitted at once; their results once all have finished; the engine stopped."""
    async def all_at_once() -> list:
        return await asyncio.gather(*(collect_translation(engine, engine.submit(j)) for j in jobs))

    try:
        return asyncio.run(all_at_once())
    finally:
        engine.stop()


def test_preempted_requests_finish_as_alone(mt):
    """24 greedy and beam requests (three with a glossary term) at once on a pool that holds a few of them at
    their longest: requests are preempted (the pool is what limits them, not the rows), and every one ends with
    the ids it gives alone; greedy ones streamed each token once (the streamed ids are compared)."""
    engine = small_pool_engine(mt, blocks=60)
    jobs = mixed_jobs(engine, lexicon_sentences(24, seed=5, min_words=4, max_words=14))
    for job in jobs[1:10:3]:  # 4-beam jobs with a glossary term: the constrained search replays too
        first = job_tokens(mt, job)[0]
        job.constraints, job.constraint_terms = [[first]], [mt.tokenizer.decode([first]).strip()]
    expected = [job_tokens(mt, j) for j in jobs]
    assert_varied(expected)
    results = translate_all(engine, jobs)
    assert_translations_as_alone(mt, jobs, results, expected)
    assert engine.m.preemptions._value.get() >= 3
    assert engine.rows_in_use == 0 and engine.runner.blocks_in_use == 0 and engine.runner.cross_slots_held == 0
    # What is left: encoder outputs kept for an identical source, each holding exactly its source's blocks.
    runner = engine.runner
    assert runner.blocks.num_in_use == runner.blocks_kept == sum(
        runner.blocks.blocks_for(len(source)) for source in runner._slot_of_source)


def test_the_pool_is_sized_by_memory(mt):
    """The budget sets the blocks (not rows x the longest output), and /metrics reports them."""
    engine = small_pool_engine(mt, blocks=60, max_rows=64)
    try:
        assert engine.runner.blocks.num_usable == 60
        assert engine.runner.cache.self_kv.num_blocks == 61  # and the null block
        assert engine.m.kv_blocks_total._value.get() == 60
        assert engine.m.kv_block_size._value.get() == BLOCK
        assert engine.m.kv_bytes_per_token._value.get() == kv_block_bytes(mt, BLOCK) // BLOCK
    finally:
        engine.stop()


def test_a_request_larger_than_the_pool_is_refused(mt):
    """One whose beams at their longest need more blocks than the pool has could never finish: refused at once
    (a 400 over HTTP), not preempted forever."""
    engine = small_pool_engine(mt, blocks=60)

    async def scenario() -> None:
        with pytest.raises(ValueError, match="KV-cache blocks"):
            engine.submit(engine.translator.job("hello world", num_beams=4, max_tokens=60))
        engine.submit(engine.translator.job("hello world", num_beams=4, max_tokens=40))  # a block of source, 4 x 10: fits

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_the_servers_settings_size_a_translators_pool(tmp_path):
    """--kv-cache-memory and --kv-block-size reach a translator the server loads, and /metrics reports its pool."""
    from tserve.service.registry import ModelRegistry
    from tserve.service.settings import Settings

    d = factories.tiny_mt_dir(tmp_path / "mt")
    block_bytes = kv_block_bytes(checkpoint.load(d), BLOCK)
    registry = ModelRegistry(Settings(kv_cache_memory=f"{60 * block_bytes}B", kv_block_size=BLOCK, warmup=False),
                             Metrics())
    registry.load_model("mt", d)
    try:
        engine = registry.models["mt"].engine
        assert engine.runner.blocks.num_usable == 60 and engine.runner.blocks.block_size == BLOCK
        text = registry.metrics.render().decode()
        assert 'tserve_kv_cache_blocks_total{model="mt"} 60.0' in text
    finally:
        registry.unload_model("mt")


def test_kept_encoder_outputs_give_their_blocks_up_the_oldest_first(mt, monkeypatch):
    """Encoded sources take blocks of the same pool as decoder rows. One kept for an identical source holds them
    until a running request needs them; then the output unread the longest goes first, and the request goes on
    (run alone here, it could not be preempted). A source whose output went is encoded again, one still kept is
    not, and every translation equals its source's alone."""
    from tests.engine.test_paged_engine import counting_encoder
    from tserve.model.decoding import Seq2SeqRunner, translation_job
    from tserve.model.decoding.seq2seq_runner import run_jobs

    encode = mt.tokenizer.encode
    short = [encode(t) for t in dict.fromkeys(lexicon_sentences(12, seed=3, min_words=1, max_words=2))][:3]
    long = encode(max(lexicon_sentences(20, seed=4, min_words=10, max_words=14), key=lambda t: len(job_tokens(
        mt, translation_job(mt, encode(t), num_beams=1)))))
    alone = {tuple(s): job_tokens(mt, translation_job(mt, s, num_beams=1)) for s in [*short, long]}
    def blocks_for(n: int) -> int:
        return -(-n // BLOCK)

    src_blocks = [blocks_for(len(s)) for s in short]
    long_peak = blocks_for(len(long)) + blocks_for(len(alone[tuple(long)]))  # its source, and its row at its end
    # Room for the long translation at its peak and the last short source: the two older ones must give way.
    runner = Seq2SeqRunner(mt, num_rows=4, cuda_graphs=False, block_size=BLOCK,
                           num_blocks=1 + long_peak + src_blocks[2])
    assert long_peak - src_blocks[0] - src_blocks[1] >= blocks_for(len(long)) + 1  # admitted with all three kept
    encoder = counting_encoder(runner, monkeypatch)

    def translate(source: list[int]) -> None:
        (seq,) = run_jobs(mt, [translation_job(mt, source, num_beams=1)], runner=runner)
        assert seq.output_ids == alone[tuple(source)]

    for source in short:
        translate(source)
    assert runner.blocks_kept == sum(src_blocks) and runner.blocks_in_use == 0
    translate(long)
    assert sum(encoder) == 4 and runner.blocks_kept == src_blocks[2] + blocks_for(len(long))
    translate(short[2])  # still kept: read, not encoded
    assert sum(encoder) == 4
    translate(short[0])  # given up: encoded again
    assert sum(encoder) == 5


def test_a_source_longer_than_the_runner_holds_claims_nothing(mt):
    from tserve.model.decoding import Seq2SeqRunner, TranslationSequence, translation_job

    runner = Seq2SeqRunner(mt, num_rows=2, cuda_graphs=False, max_len=16, block_size=BLOCK)
    with pytest.raises(ValueError, match="20 tokens"):
        runner.reserve(TranslationSequence(translation_job(mt, list(range(5, 25)), num_beams=1)))
    assert runner.blocks.num_in_use == 0 and runner.cross_slots.num_used == 0 and runner.rows.num_used == 0
