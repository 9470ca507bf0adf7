"""What /metrics reports, compared with what the requests did, where the counting meets another option: a
translator's generated tokens greedy and with beams, in a pool small enough to preempt (a replayed position is no
new token); the queue depth of a request of several choices; inter-token gaps of streams read coalesced; the KV
gauges of beams and of a translator idle with sources kept for reuse; gauges back at zero once a client left;
translation-memory misses beside hits in one request; batched models (a classifier, an embedding batcher) that
count their inputs and hold no KV cache; a model unloaded and loaded again under its name. Engines and apps run in
this process, so that the tests take seconds."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.engine.test_translation_preemption import mixed_jobs, small_pool_engine, translate_all
from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts, lexicon_sentences
from tests.helpers.in_process import InProcessApp
from tests.helpers.polling import until
from tserve.model.decoding import SamplingParams
from tserve.service.engine import GenerationEngine, TranslationEngine
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.settings import Settings
from tserve.service.translation.served import collect_translation

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return factories.tiny_lm_loaded(tmp_path_factory.mktemp("metrics-lm"), "layers")


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return factories.tiny_mt_loaded(tmp_path_factory.mktemp("metrics-mt"), "plain")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-app")
    served = InProcessApp({"lm": TINY_LM, "mt": factories.aligned_mt_dir(root / "mt"),
                           "vit": factories.tiny_vit_dir(root / "vit")},
                          gc_freeze=False, file_dir=str(root / "files"),
                          translation_memory=str(root / "memory.sqlite"))
    yield served
    served.stop()


def sample(metrics: Metrics, name: str, model: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": model})


def lm_engine(lm, **kw) -> GenerationEngine:  # noqa: ANN001
    return GenerationEngine("lm", lm, metrics=Metrics(), **({"max_slots": 4, "max_queue": 16, "max_model_len": 128,
                                                             "timeout_s": 60.0, "kv_block_size": 4} | kw))


# --------------------------------------------------------------------------------------------------
# Generated tokens
# --------------------------------------------------------------------------------------------------
def test_a_translators_generated_tokens_are_its_steps_greedy_with_beams_and_when_preempted(mt):
    """Greedy and beam translations at once, on a pool that preempts them and on one that does not: a preempted
    request replays the positions it had, which are not generated again, so both engines count the same tokens;
    a beam request's steps count as its tokens (at least as many as its best hypothesis has), not only greedy
    rows' tokens."""
    texts = lexicon_sentences(24, seed=5, min_words=4, max_words=14)

    def run(engine: TranslationEngine) -> tuple[float, list]:
        results = translate_all(engine, mixed_jobs(engine, texts))
        return engine.m.generated_tokens._value.get(), results

    roomy = TranslationEngine("mt", mt, max_rows=16, max_queue=100, timeout_s=120, metrics=Metrics())
    roomy.start()
    counted, results = run(roomy)
    small = small_pool_engine(mt, blocks=60)
    counted_small, results_small = run(small)
    assert small.m.preemptions._value.get() > 0 and roomy.m.preemptions._value.get() == 0
    assert [r.token_ids for r in results_small] == [r.token_ids for r in results]
    assert counted_small == counted
    beams = [r for i, r in enumerate(results) if i % 3]
    greedy = [r for i, r in enumerate(results) if not i % 3]
    # Greedy rows count each token and their end of sequence; beam requests at least their best hypothesis.
    assert counted >= sum(len(r.token_ids) + (r.finish_reason == "stop") for r in greedy) + sum(
        len(r.token_ids) for r in beams) > sum(len(r.token_ids) + 1 for r in greedy)


# --------------------------------------------------------------------------------------------------
# Gauges
# --------------------------------------------------------------------------------------------------
def test_queue_depth_counts_a_request_of_several_choices_once_and_the_gauges_return_to_zero(lm):
    """A completion with n=3 (or several prompts) is one client request waiting, as --max-queue counts it; a
    second request makes two. Once every one has run, the queue, running and KV gauges are back at zero."""
    engine = lm_engine(lm)
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(2, seed=61)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        reqs = engine.submit_all([(prompts[0], params)] * 3)
        assert sample(engine.metrics, "tserve_queue_depth", "lm") == 1
        reqs += engine.submit_all([(prompts[1], params)])
        assert sample(engine.metrics, "tserve_queue_depth", "lm") == 2
        engine.start()
        for r in reqs:
            async for _ in engine.stream(r):
                pass
        await until(lambda: engine.idle and sample(engine.metrics, "tserve_running_requests", "lm") == 0)

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    for name in ("tserve_queue_depth", "tserve_running_requests", "tserve_kv_slots_in_use",
                 "tserve_kv_cache_blocks_in_use"):
        assert sample(engine.metrics, name, "lm") == 0, name
    assert sample(engine.metrics, "tserve_generated_tokens_total", "lm") == 4 * 6


def test_a_request_whose_client_left_while_alone_leaves_the_gauges_at_zero(lm):
    """The only running request is cancelled (its client left): the step that retires it runs nothing else, and
    the running and KV gauges must still drop to zero, not keep the request a leaving client held."""
    engine = lm_engine(lm)
    engine.start()
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=62)[0])

    async def run() -> None:
        req = engine.submit(prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        async for _ in engine.stream(req):
            await until(lambda: sample(engine.metrics, "tserve_running_requests", "lm") == 1)
            break  # leaving the stream cancels the request
        await until(lambda: engine.idle)
        await asyncio.sleep(0.1)  # the worker's loop goes back to waiting

    try:
        asyncio.run(run())
        for name in ("tserve_running_requests", "tserve_kv_slots_in_use", "tserve_kv_cache_blocks_in_use"):
            assert sample(engine.metrics, name, "lm") == 0, name
    finally:
        engine.stop()


def test_kv_slots_in_use_count_each_beam_row_and_an_idle_translator_holds_no_blocks(mt):
    """A 4-beam translation takes four decoder rows, a greedy one one: the rows gauge reads 5 while both run.
    Once idle, the encoder outputs kept for an identical source hold blocks, but no running request does: the
    blocks-in-use gauge reads zero."""
    engine = TranslationEngine("mt", mt, max_rows=8, max_queue=16, timeout_s=60.0, metrics=Metrics())
    seen: list[float] = []
    engine.fault_hook = lambda req: seen.append(engine.m.kv_in_use._value.get())
    a, b = lexicon_sentences(2, seed=63, min_words=4, max_words=8)
    jobs = [engine.translator.job(a, num_beams=4, max_tokens=8), engine.translator.job(b, num_beams=1, max_tokens=8)]

    async def run() -> list:
        reqs = [engine.submit(j) for j in jobs]  # queued before the worker starts: admitted in one step
        engine.start()
        results = await asyncio.gather(*(collect_translation(engine, r) for r in reqs))
        await until(lambda: engine.idle)
        await asyncio.sleep(0.1)
        return results

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    assert max(seen) == 5
    assert engine.runner.blocks.num_in_use > 0  # the sources kept for reuse
    assert engine.m.kv_blocks_in_use._value.get() == 0 and engine.m.kv_in_use._value.get() == 0


# --------------------------------------------------------------------------------------------------
# Latency histograms
# --------------------------------------------------------------------------------------------------
def test_inter_token_gaps_are_measured_from_the_previous_token_when_streams_are_read_coalesced(lm):
    """Streams read with coalescing (several tokens an event) still record one gap per token after the first,
    each from the token before it: a request's gaps add up to the time from its first token to its last."""
    engine = lm_engine(lm)
    engine.start()
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(3, seed=64)]

    async def run() -> list:
        reqs = [engine.submit(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in prompts]
        for r in reqs:
            async for _ in engine.stream(r, coalesce=True):
                pass
        return reqs

    try:
        reqs = asyncio.run(run())
    finally:
        engine.stop()
    m = engine.metrics
    assert sample(m, "tserve_time_to_first_token_seconds_count", "lm") == 3
    assert sample(m, "tserve_inter_token_latency_seconds_count", "lm") == sum(len(r.generated) - 1 for r in reqs)
    # Gaps measured from the first token instead would add up to some 55 steps' time a request, not 11: a margin of
    # 5 ms a request (the two clocks are read a few instructions apart) tells them apart on any machine.
    spans = sum((r.finished_ns - r.first_token_ns) / 1e9 for r in reqs)
    assert sample(m, "tserve_inter_token_latency_seconds_sum", "lm") <= spans + 0.005 * len(reqs)


# --------------------------------------------------------------------------------------------------
# Served models: the translation memory, batched models, a model loaded again
# --------------------------------------------------------------------------------------------------
def test_a_request_of_remembered_and_new_sentences_counts_each_once_as_a_hit_or_a_miss(app):
    """A request of two inputs, one the memory holds and one it does not: one hit and one miss more, not a
    miss for every sentence looked up."""
    def metric(name: str) -> float:
        return sample(app.app.state.metrics, name, "mt") or 0.0

    body = {"model": "mt", "num_beams": 1, "max_tokens": 30}
    app.post("/v1/translations", body | {"input": "hello world"})
    hits, misses = metric("tserve_translation_memory_hits_total"), metric("tserve_translation_memory_misses_total")
    app.post("/v1/translations", body | {"input": ["hello world", "good morning"]})
    assert metric("tserve_translation_memory_hits_total") == hits + 1
    assert metric("tserve_translation_memory_misses_total") == misses + 1



def test_a_sentence_a_request_holds_twice_counts_twice_as_a_miss_and_then_as_a_hit(app):
    """The memory's counts are per sentence asked for: a request that holds one sentence twice counts two misses
    cold, and two hits once the memory holds it, as the metrics and the memory's own counters both say."""
    memory = app.registry.models["mt"].memory

    def now() -> tuple[float, float, int, int]:
        return (sample(app.app.state.metrics, "tserve_translation_memory_hits_total", "mt") or 0.0,
                sample(app.app.state.metrics, "tserve_translation_memory_misses_total", "mt") or 0.0,
                memory.hits, memory.misses)

    body = {"model": "mt", "num_beams": 1, "max_tokens": 30,
            "input": ["the small dog sleeps", "the small dog sleeps", "the cat is here"]}
    before = now()
    app.post("/v1/translations", body)
    cold = now()
    assert [c - b for c, b in zip(cold, before, strict=True)] == [0, 3, 0, 3]
    app.post("/v1/translations", body)
    assert [w - c for w, c in zip(now(), cold, strict=True)] == [3, 0, 3, 0]

def _png() -> str:
    import base64

    buf = io.BytesIO()
    Image.new("L", (28, 28), 80).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_batched_models_count_their_inputs_and_report_no_kv_cache(app):
    """A classification of two images counts two; embeddings of three inputs count three. Neither the classifier
    nor a model's embedding batcher holds a KV cache: they have no KV-slot series (a batch's rows are not cache
    rows), while the language model keeps its own."""
    metrics = app.app.state.metrics
    images = sample(metrics, "tserve_images_classified_total", "vit") or 0.0
    embedded = sample(metrics, "tserve_embeddings_total", "lm") or 0.0
    app.post("/v1/classifications", {"model": "vit", "images": [_png(), _png()]})
    app.post("/v1/embeddings", {"model": "lm", "input": ["Good morning", "Hello", "The cat"]})
    assert sample(metrics, "tserve_images_classified_total", "vit") == images + 2
    assert sample(metrics, "tserve_embeddings_total", "lm") == embedded + 3
    for model in ("vit", "vit/embeddings", "lm/embeddings"):
        assert sample(metrics, "tserve_kv_slots_total", model) is None, model
        assert sample(metrics, "tserve_kv_slots_in_use", model) is None, model
    assert sample(metrics, "tserve_running_requests", "vit") == 0
    assert sample(metrics, "tserve_kv_slots_total", "lm") > 0


def test_a_model_unloaded_and_loaded_again_under_its_name_counts_afresh(app):
    """Unloading drops a model's series; loaded again under that name, it reports its new requests in fresh
    series: neither missing (the old ones were removed) nor added to the unloaded model's counts."""
    metrics, reg = app.app.state.metrics, app.registry
    body = {"model": "again", "prompt": "Good", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    reg.load_model("again", TINY_LM)
    try:
        app.post("/v1/completions", body)
        assert sample(metrics, "tserve_generated_tokens_total", "again") == 3
        reg.unload_model("again")
        assert sample(metrics, "tserve_generated_tokens_total", "again") is None
        reg.load_model("again", TINY_LM)
        app.post("/v1/completions", body | {"n": 2})
        assert sample(metrics, "tserve_generated_tokens_total", "again") == 6
        assert sample(metrics, "tserve_time_to_first_token_seconds_count", "again") == 2
        assert sample(metrics, "tserve_kv_slots_total", "again") > 0
        deadline = time.monotonic() + 5
        while sample(metrics, "tserve_running_requests", "again") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sample(metrics, "tserve_running_requests", "again") == 0
    finally:
        reg.unload_model("again")


def test_a_replaced_model_draining_leaves_the_names_gauges_to_the_new_one():
    """A model replaced under its name drains what it holds: while it does, the name's gauges (running requests,
    the queue, the cache in use) are the new model's, not overwritten by the old one's steps, and what the old one
    finishes still counts (its tokens are generated under that name)."""
    metrics = Metrics()
    reg = ModelRegistry(Settings(device="cpu", warmup=False, gc_freeze=False), metrics)
    try:
        reg.load_model("lm", TINY_LM)
        old = reg.models["lm"].worker
        served = reg.prepare("lm", TINY_LM)
        assert reg.install("lm", served)
        new = reg.models["lm"].worker
        assert new is not old
        new.m.running.set(0)
        new.m.queue_depth.set(0)
        old.m.running.set(3)  # what the old one's steps write while it drains
        old.m.queue_depth.set(2)
        assert sample(metrics, "tserve_running_requests", "lm") == 0
        assert sample(metrics, "tserve_queue_depth", "lm") == 0
        tokens = sample(metrics, "tserve_generated_tokens_total", "lm") or 0.0
        old.m.generated_tokens.inc(5)
        assert sample(metrics, "tserve_generated_tokens_total", "lm") == tokens + 5
        reg.retire()
    finally:
        reg.stop()
