"""What a request that failed, timed out or was preempted leaves behind in an engine: nothing. The request after
it (same prompt or source, same options) gives what it gives on a fresh engine, token for token, and every row,
KV block, draft-cache block and cross slot is back where it was before. Each test fails one request at a point
of its life the other engine tests do not reach: in its prefill, in its first speculative step, in its
encoder, in the queue after a preemption."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.test_option_combinations_speculative import lm, lm_dir, twin  # noqa: F401 - module fixtures
from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts, lexicon_sentences
from tests.helpers.hooked_server import slow_steps
from tests.helpers.one_request import job_tokens, lm_tokens
from tests.helpers.polling import until
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams, Speculation, sampler, translation_job
from tserve.service.engine import GenerationEngine, RequestTimeout, TranslationEngine
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BLOCK = 4  # small blocks: short prompts fill several, so the prefix cache has something to name


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("mt-after-failures")), device="cpu")


def lm_engine(loaded, **kw) -> GenerationEngine:  # noqa: ANN001
    opts = {"max_slots": 4, "max_queue": 16, "max_model_len": 96, "timeout_s": 60.0, "kv_block_size": BLOCK} | kw
    engine = GenerationEngine("lm", loaded, metrics=Metrics(), **opts)
    engine.start()
    return engine


async def outcome(engine, req, within: float = 10.0):  # noqa: ANN001, ANN201
    """The request's token ids, or the error it ended with; a request that never ends fails the test."""
    async def read() -> list[int]:
        return [t async for e in engine.stream(req) for t in e.token_ids]

    try:
        return await asyncio.wait_for(read(), within)
    except asyncio.TimeoutError:
        pytest.fail("the request never ended")
    except Exception as exc:  # noqa: BLE001 - the request's own error is the outcome
        return exc


def metric(engine, name: str) -> float:  # noqa: ANN001
    text = engine.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def failing_once(monkeypatch, owner, name: str, when) -> dict:  # noqa: ANN001
    """`owner.name` raises the first time `when(*args)` holds; the calls that raised are counted."""
    original, state = getattr(owner, name), {"raised": 0}

    def method(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not state["raised"] and when(*args):
            state["raised"] += 1
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, method)
    return state


def test_a_prompt_whose_prefill_failed_runs_again_as_on_a_fresh_engine(lm, monkeypatch):  # noqa: F811
    """A prefill that fails leaves blocks the failed request never wrote: they must not be named in the prefix
    cache (a later prompt would read them as its own prefix), and the names it was about to compute must not
    stay pending (a later identical prompt would wait for them forever). The same prompt, then one that
    extends it, run next as they run on a fresh engine, from no cached block of the failed request."""
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=31, min_words=8, max_words=8)[0])
    longer = prompt + lm.tokenizer.encode(" and more", add_special_tokens=False)
    assert len(prompt) > 3 * BLOCK
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fresh = [lm_tokens(lm, p, params) for p in (prompt, longer)]
    engine = lm_engine(lm)
    free = engine.runner.blocks.num_free
    fault = failing_once(monkeypatch, lm.model, "prefill", lambda tokens, *a: tokens.shape[1] == len(prompt))

    async def run() -> list:
        failed = await outcome(engine, engine.submit(prompt, params))
        again = [engine.submit(p, params) for p in (prompt, longer)]
        return [failed, *[await outcome(engine, r) for r in again], again]

    try:
        failed, same, extended, again = asyncio.run(run())
    finally:
        engine.stop()
    assert fault["raised"] == 1
    assert isinstance(failed, RuntimeError) and str(failed) == "generation failed: RuntimeError"
    assert [same, extended] == fresh
    assert again[0].cached_tokens == 0  # nothing of the failed prefill was found in the cache
    assert engine.runner.blocks.num_free == free and engine.runner.slots.num_used == 0
    assert engine.runner._pending == {}  # noqa: SLF001 - what a later identical prompt would wait for


def test_a_preempted_request_that_times_out_in_the_queue_gives_its_row_back_once(lm):  # noqa: F811
    """Two requests in a pool too small for both: the newer is preempted (its row and blocks go back) and then
    runs past its deadline while it waits to be admitted again. Timing out must not give back the row it held
    before the preemption a second time: the older request, running on, finishes as it does alone, every row
    and block is back once, and the request after it gives what it gives on a fresh engine."""
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(3, seed=33)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    block_bytes = BLOCK * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    engine = slow_steps(lm_engine(lm, max_slots=2, max_model_len=64,
                                    kv_cache_budget=(16 * block_bytes, None)), 0.01)
    assert engine.runner.blocks.num_usable == 16  # one request of 54 positions takes 14 of them
    after = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> list:
        old, new = (engine.submit(p, params) for p in prompts[:2])
        results = asyncio.gather(outcome(engine, old), outcome(engine, new))
        await until(lambda: new.generated and new.table is None and new in list(engine.waiting), timeout=20.0)
        new.deadline = 0.0  # the next admission finds it past its deadline
        first, second = await results
        return [first, second, await outcome(engine, engine.submit(prompts[2], after))]

    try:
        older, newer, later = asyncio.run(run())
    finally:
        engine.stop()
    assert metric(engine, "tserve_preemptions_total") >= 1
    assert isinstance(newer, RequestTimeout)
    assert older == lm_tokens(lm, prompts[0], params)
    assert later == lm_tokens(lm, prompts[2], after)
    assert engine.runner.slots.num_free == 2 and engine.runner.slots.num_used == 0
    assert engine.runner.blocks.num_in_use == 0


def test_a_request_failing_in_its_first_speculative_step_gives_its_draft_blocks_back(lm, twin, monkeypatch):  # noqa: F811
    """With a draft model, a step first has the draft model catch up and draft (its cache takes blocks), then the
    target scores the drafts. When that scoring fails in a request's first speculative step, the draft cache
    has not yet been told what the target kept: its blocks must go back all the same. Every block of both
    caches is back, and the same prompt then speculates as on a fresh engine (every draft of the twin kept)."""
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=35)[0])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fresh = lm_tokens(lm, prompt, params)
    engine = lm_engine(lm, speculation=Speculation(num_tokens=3), draft=twin)
    drafter = engine.runner.drafter
    fault = failing_once(monkeypatch, engine.runner, "decode_ahead", lambda seqs, drafts: any(drafts))

    async def run() -> list:
        failed = await outcome(engine, engine.submit(prompt, params))
        in_use = drafter.blocks.num_in_use
        req = engine.submit(prompt, params)
        return [failed, in_use, await outcome(engine, req), req]

    try:
        failed, draft_blocks_after_failure, again, req = asyncio.run(run())
    finally:
        engine.stop()
    assert fault["raised"] == 1
    assert isinstance(failed, RuntimeError)
    assert draft_blocks_after_failure == 0
    assert again == fresh
    assert req.drafted > 0 and req.accepted == req.drafted
    assert drafter.blocks.num_in_use == 0 and engine.runner.blocks.num_in_use == 0
    assert engine.runner.slots.num_used == 0


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_source_whose_encoding_failed_is_encoded_again_for_the_next_request(mt, monkeypatch, num_beams):
    """A failed encoder run wrote nothing into the request's cross slot: the slot must not be kept as holding
    that source's encoder output, or the next identical source (greedy or beams) would read an output never
    written. The next one is encoded again and translates as on a fresh engine; every row, block and cross
    slot is back."""
    source = mt.tokenizer.encode(lexicon_sentences(1, seed=37, min_words=4, max_words=6)[0])
    job = translation_job(mt, source, num_beams=num_beams, max_new_tokens=10)
    fresh = job_tokens(mt, job)
    engine = TranslationEngine("mt", mt, max_rows=4, max_queue=8, timeout_s=60.0, metrics=Metrics())
    engine.start()
    fault = failing_once(monkeypatch, mt.model, "start", lambda src, *a: src.shape[1] == len(source))

    async def run() -> list:
        failed = await outcome(engine, engine.submit(translation_job(mt, source, num_beams, 10)))
        return [failed, await outcome(engine, engine.submit(translation_job(mt, source, num_beams, 10)))]

    try:
        failed, again = asyncio.run(run())
    finally:
        engine.stop()
    assert fault["raised"] == 1
    assert isinstance(failed, RuntimeError)
    assert again == fresh
    assert metric(engine, "tserve_encoder_cache_hits_total") == 0
    assert engine.rows_in_use == 0 and engine.runner.cross_slots_held == 0 and engine.runner.blocks_in_use == 0


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_a_choice_that_fails_for_one_row_of_a_batch_leaves_the_others_as_alone(lm, step):  # noqa: F811
    """A step's forward pass writes and counts its positions before its tokens are chosen; when the choice fails
    for one row (its logits no distribution), the batch's other rows take the tokens they take alone. Running the
    forward again for each would feed every token one position on (or, after a prefill, nothing at all)."""
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(4, seed=1)]
    bad = prompts[2]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = [lm_tokens(lm, p, params) for p in prompts]
    engine = lm_engine(lm)
    choose_later, calls = engine.runner.choose_later, {"batched": 0}

    def failing_choose_later(seqs, logits):  # noqa: ANN001, ANN202
        at_step = (lambda s: not s.generated) if step == "prefill" else (lambda s: len(s.generated) == 1)
        if any(s.prompt_ids == bad and at_step(s) for s in seqs):
            calls["batched"] += len(seqs) > 1
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return choose_later(seqs, logits)

    engine.runner.choose_later = failing_choose_later

    async def run() -> list:
        reqs = [engine.submit(p, params) for p in prompts]
        return [await outcome(engine, r) for r in reqs]

    try:
        got = asyncio.run(run())
    finally:
        engine.stop()
    assert calls["batched"] >= 1  # the failure met the others in one batch
    assert isinstance(got[2], RuntimeError)
    assert [g for i, g in enumerate(got) if i != 2] == [a for i, a in enumerate(alone) if i != 2]
    assert engine.runner.slots.num_used == 0


@pytest.mark.parametrize("path", ["in-order", "async-scheduling", "speculative"])
def test_a_seeded_request_chosen_again_after_its_batchs_choice_failed_draws_as_alone(lm, twin, monkeypatch, caplog,  # noqa: F811
                                                                                      path):
    """A seeded sampled request beside one whose draw fails (its logits no distribution) has drawn from its own
    generator already in the batch's failed choice; chosen again alone, it draws what it draws alone, not the
    generator's next noise: its tokens are those of the same seeded request with no neighbour, whichever step
    loop ran it (tokens read before the next step, after it, or scored ahead from drafts)."""
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(2, seed=43)]
    seeded = SamplingParams(max_tokens=12, temperature=2.0, seed=7, ignore_eos=True)
    alone = lm_tokens(lm, prompts[0], seeded)
    kw = {"speculative": {"speculation": Speculation(num_tokens=3), "draft": twin},
          "async-scheduling": {"async_scheduling": "on"}}.get(path, {"async_scheduling": "off"})
    engine = lm_engine(lm, **kw)
    failing: list = []
    noise = sampler.exponential_noise

    def exponential_noise(vocab_size, generator):  # noqa: ANN001, ANN202
        if failing and generator is failing[0].generator and len(failing[0].generated) >= 2:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return noise(vocab_size, generator)

    monkeypatch.setattr(sampler, "exponential_noise", exponential_noise)

    async def run() -> list:
        reqs = [engine.submit(prompts[0], seeded),
                engine.submit(prompts[1], SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))]
        failing.append(reqs[1])
        return [await outcome(engine, r) for r in reqs]

    try:
        with caplog.at_level("WARNING", logger="tserve.engine"):
            got, failed = asyncio.run(run())
    finally:
        engine.stop()
    assert isinstance(failed, RuntimeError)
    assert any("one by one" in r.getMessage() for r in caplog.records)  # the failure met the seeded one in a batch
    assert got == alone
    assert engine.runner.slots.num_used == 0


def test_a_beam_group_whose_step_failed_counts_no_token_and_leaves_the_others_as_alone(mt):
    """A beam group whose step fails fails its requests alone: a greedy request beside it translates as it does
    on a fresh engine, and the engine counts the tokens of that request only (the failed group's step is not
    recorded as generated)."""
    sources = [mt.tokenizer.encode(s) for s in lexicon_sentences(2, seed=41, min_words=4, max_words=6)]
    greedy_job = translation_job(mt, sources[0], num_beams=1, max_new_tokens=10)
    fresh = TranslationEngine("mt", mt, max_rows=4, max_queue=8, timeout_s=60.0, metrics=Metrics())
    fresh.start()
    async def run_alone() -> list[int]:
        return await outcome(fresh, fresh.submit(greedy_job))

    try:
        alone = asyncio.run(run_alone())
    finally:
        fresh.stop()
    engine = TranslationEngine("mt", mt, max_rows=4, max_queue=8, timeout_s=60.0, metrics=Metrics())
    beam_steps = {"failed": 0}

    def failing_advance_beams(group, logits, span):  # noqa: ANN001, ANN202
        beam_steps["failed"] += 1
        raise RuntimeError("injected fault")

    engine.runner._advance_beams = failing_advance_beams  # noqa: SLF001
    engine.start()

    async def run() -> list:
        reqs = [engine.submit(translation_job(mt, sources[0], 1, 10)),
                engine.submit(translation_job(mt, sources[1], 3, 10))]
        return [await outcome(engine, r) for r in reqs]

    try:
        greedy, beams = asyncio.run(run())
    finally:
        engine.stop()
    assert beam_steps["failed"] == 1 and isinstance(beams, RuntimeError)
    assert greedy == alone
    assert metric(engine, "tserve_generated_tokens_total") == metric(fresh, "tserve_generated_tokens_total") > 0
    assert engine.rows_in_use == 0


def test_a_queued_request_whose_release_fails_loses_no_other_request(lm, monkeypatch):  # noqa: F811
    """Giving back the rows of a request that timed out in the queue raises (a fault of the engine's own): that
    request's client still hears of its timeout, the step loop restarts (failing what was running, as it does
    for any fault of its own), and a request queued behind it is neither lost nor left waiting: it runs as alone."""
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=53)[0])
    long_params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)  # running still when the others come
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = lm_tokens(lm, prompt, params)
    engine = slow_steps(lm_engine(lm, max_slots=1), 0.01)
    release = engine._release  # noqa: SLF001

    def failing_release(req):  # noqa: ANN001, ANN202
        if req is doomed[0]:
            raise RuntimeError("injected fault")
        return release(req)

    monkeypatch.setattr(engine, "_release", failing_release)
    doomed: list = [None]

    async def run() -> list:
        running = engine.submit(prompt, long_params)
        await until(lambda: engine.running and not engine.waiting)
        doomed[0] = engine.submit(prompt, params)
        doomed[0].deadline = 0.0  # past: it times out in the queue at the next admission
        behind = engine.submit(prompt, params)
        return [await outcome(engine, r) for r in (running, doomed[0], behind)]

    try:
        running, timed_out, behind = asyncio.run(run())
    finally:
        engine.stop()
    assert isinstance(timed_out, RequestTimeout)
    assert isinstance(running, Exception) and engine.restarts == 1
    assert behind == alone


@pytest.mark.parametrize("kind", ["lm", "mt"])
def test_a_request_whose_rows_cannot_be_claimed_fails_alone_and_the_queue_goes_on(lm, mt, monkeypatch, kind):  # noqa: F811
    """Claiming a queued request's rows raises (input its runner cannot hold, found only then): that request
    ends with its error at once, never lost off the queue to hang its client, the step loop does not restart, and
    the requests queued beside it run as alone."""
    if kind == "lm":
        prompt = lm.tokenizer.encode(cycle_prompts(1, seed=57)[0])
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        alone = lm_tokens(lm, prompt, params)
        engine = lm_engine(lm)
        submit = lambda: engine.submit(prompt, params)  # noqa: E731
    else:
        source = mt.tokenizer.encode(lexicon_sentences(1, seed=57, min_words=4, max_words=6)[0])
        alone = job_tokens(mt, translation_job(mt, source, num_beams=1, max_new_tokens=10))
        engine = TranslationEngine("mt", mt, max_rows=4, max_queue=8, timeout_s=60.0, metrics=Metrics())
        engine.start()
        submit = lambda: engine.submit(translation_job(mt, source, 1, 10))  # noqa: E731
    doomed: list = [None]
    fault = failing_once(monkeypatch, engine, "_reserve", lambda req: req is doomed[0])

    async def run() -> list:
        before = submit()
        doomed[0] = submit()
        after = submit()
        return [await outcome(engine, r) for r in (before, doomed[0], after)]

    try:
        before, failed, after = asyncio.run(run())
    finally:
        engine.stop()
    assert fault["raised"] == 1
    assert isinstance(failed, Exception) and not isinstance(failed, RequestTimeout), failed
    assert engine.restarts == 0
    assert before == after == alone
