"""The generation engine and the dynamic batcher in-process (no HTTP)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, cycle_prompts
from tests.helpers.hooked_server import slow_steps
from tests.helpers.one_request import lm_tokens
from tests.helpers.polling import until
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams
from tserve.service.engine import (
    DynamicBatcher,
    GenerationEngine,
    OutOfMemory,
    QueueFull,
    RequestTimeout,
    Worker,
)
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("lm")), device="cpu")


def make_engine(lm, **kw) -> GenerationEngine:
    opts = {"max_slots": 8, "max_queue": 64, "max_model_len": None, "timeout_s": 60.0} | kw
    engine = GenerationEngine("lm", lm, metrics=Metrics(), **opts)
    engine.start()
    return engine


async def collect(engine: GenerationEngine, req) -> tuple[list[int], str, str]:
    ids, text, reason = [], "", None
    async for event in engine.stream(req):
        ids += event.token_ids
        text += event.text
        reason = event.finish_reason
    return ids, text, reason


def slowed(engine: GenerationEngine) -> GenerationEngine:
    """Steps of at least 20 ms: a request of many tokens is still running when the test acts on it."""
    return slow_steps(engine, 0.02)


def test_greedy_alone_equals_among_fifty_others(lm):
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(50)]
    lengths = [5 + (i * 7) % 30 for i in range(50)]  # requests finish at different steps: slots churn
    reference = [lm_tokens(lm, p, SamplingParams(max_tokens=n, temperature=0.0), with_eos=False)
                 for p, n in zip(prompts, lengths, strict=True)]
    assert_varied(reference)
    engine = make_engine(lm)

    async def run() -> list:
        reqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0))
                for p, n in zip(prompts, lengths, strict=True)]
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    try:
        results = asyncio.run(run())
    finally:
        engine.stop()
    assert [ids for ids, _, _ in results] == reference
    for (ids, text, _), prompt in zip(results, prompts, strict=True):
        full = lm.tokenizer.decode(prompt + ids)
        assert full.endswith(text)


def run_together(lm, jobs: list[tuple[list[int], SamplingParams]], **engine_opts) -> list[list[int]]:
    """Every job submitted before the engine's first step (so they share its batches); their token ids."""
    engine = make_engine(lm, **engine_opts)

    async def run() -> list:
        reqs = [engine.submit(p, sp) for p, sp in jobs]
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    try:
        return [ids for ids, _, _ in asyncio.run(run())]
    finally:
        engine.stop()


def test_a_stop_string_completed_by_the_last_flush_cuts_and_stops(lm):
    """At the length limit, the detokenizer lets go of what it held (here half a character, which decodes to
    U+FFFD); when that completes a stop string, the text is cut and the finish reason is "stop"."""
    (half,) = lm.tokenizer.encode("é", add_special_tokens=False)[:1]  # the first byte of a 2-byte character
    params = dict(temperature=0.0, logit_bias={half: 100.0}, max_tokens=2)
    engine = make_engine(lm)

    async def run() -> list:
        return [await collect(engine, engine.submit(lm.tokenizer.encode("Hello"), SamplingParams(**params, stop=s)))
                for s in (["\ufffd"], [])]

    try:
        (ids, text, reason), (_, plain_text, plain_reason) = asyncio.run(run())
    finally:
        engine.stop()
    assert ids == [half, half]
    assert (text, reason) == ("", "stop")
    assert "\ufffd" in plain_text and plain_reason == "length"


def test_max_queue_0_takes_what_free_rows_take(lm):
    """--max-queue 0: no waiting room. With 2 slots, two requests are taken, a third is refused; once one has
    finished, a new one is taken again."""
    engine = slowed(make_engine(lm, max_slots=2, max_queue=0))

    async def run() -> None:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        first = engine.submit(lm.tokenizer.encode("a"), params)
        engine.submit(lm.tokenizer.encode("b"), params)
        with pytest.raises(QueueFull, match="no waiting room"):
            engine.submit(lm.tokenizer.encode("c"), params)
        await collect(engine, first)
        await until(lambda: engine.slots_in_use < 2)
        engine.submit(lm.tokenizer.encode("d"), SamplingParams(max_tokens=2, temperature=0.0))

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    batcher = DynamicBatcher("b", lambda items: items, max_batch_size=2, max_wait_ms=0, max_queue=0, metrics=Metrics())

    async def fill() -> None:
        batcher.enqueue([1, 2])  # not started: the items wait for the next batch, which takes both
        with pytest.raises(QueueFull):
            batcher.enqueue([3])

    asyncio.run(fill())


def test_cancelled_requests_behind_a_waiting_head_leave_the_queue(lm):
    """One slot, busy; the head of the queue waits for it; requests behind the head that were cancelled no
    longer count toward --max-queue."""
    engine = slowed(make_engine(lm, max_slots=1, max_queue=2))

    async def run() -> None:
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        running = engine.submit(lm.tokenizer.encode("a"), params)
        assert (await running.events.get()).token_ids
        engine.submit(lm.tokenizer.encode("b"), params)  # the head: waits for the slot
        engine.submit(lm.tokenizer.encode("c"), params).cancel()
        await until(lambda: engine.queue_depth == 1)  # the cancelled one leaves within a few steps
        engine.submit(lm.tokenizer.encode("d"), params)  # room again

    try:
        asyncio.run(run())
    finally:
        engine.stop(drain_timeout_s=0)


def test_sampled_requests_with_penalties_and_bias_alone_equal_among_others(lm):
    """Seeded sampling with penalties, top-k, top-p and logit_bias, among greedy requests, 24 at once on 8
    slots (they finish at different steps: slots churn): each gives exactly what it gives alone through the
    one-request path, and sampling gives other tokens than greedy decoding."""
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(24, seed=5)]
    variants = [dict(temperature=1.5, presence_penalty=0.8), dict(temperature=1.2, frequency_penalty=0.6, top_k=20),
                dict(temperature=1.8, top_p=0.9, logit_bias={7: 4.0, 9: -100.0}), dict(temperature=0.0),
                dict(temperature=0.0, presence_penalty=1.0, logit_bias={11: 2.0})]
    params = [SamplingParams(max_tokens=6 + (i * 5) % 15, seed=i, **variants[i % len(variants)]) for i in range(24)]
    jobs = list(zip(prompts, params, strict=True))
    alone = [lm_tokens(lm, p, sp, with_eos=False) for p, sp in jobs]
    assert_varied(alone)
    greedy = [lm_tokens(lm, p, dataclasses.replace(sp, temperature=0.0), with_eos=False) for p, sp in jobs]
    # The trained LM is sure of itself; still, sampling leaves the greedy path in a third of the sampled requests.
    assert sum(a != g for a, g, sp in zip(alone, greedy, params, strict=True) if not sp.greedy) >= 5
    assert run_together(lm, jobs) == alone


def test_logit_bias_forces_and_bans_beside_unbiased_requests(lm):
    """+100 makes a token the only choice (greedy and sampled), -100 removes it; unbiased requests in the
    same batch are unchanged."""
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(6, seed=7)]
    plain = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=1.5, seed=3, ignore_eos=True)]
    unbiased = [lm_tokens(lm, prompts[i], plain[i % 2]) for i in range(6)]
    banned = unbiased[0][0]  # the first token greedy decoding chooses for prompt 0
    forced = next(t for t in range(lm.config.vocab_size) if all(t not in u for u in unbiased) and t != lm.tokenizer.eos_id)
    bias = [{banned: -100.0}, {forced: 100.0}, {forced: 100.0}, {banned: -100.0}, {}, {}]
    jobs = [(prompts[i], dataclasses.replace(plain[i % 2], logit_bias=bias[i])) for i in range(6)]
    together = run_together(lm, jobs)
    assert together[1] == together[2] == [forced] * 10  # greedy and sampled
    assert banned not in together[0] and banned not in together[3]
    assert together[0] != unbiased[0]
    assert together[:4] == [lm_tokens(lm, p, sp) for p, sp in jobs[:4]]
    assert together[4:] == unbiased[4:]


def test_cancel_frees_the_slot_within_a_step(lm):
    engine = slowed(make_engine(lm, max_slots=2))

    async def run() -> None:
        req = engine.submit(lm.tokenizer.encode("hello"), SamplingParams(max_tokens=100, ignore_eos=True))
        first = await req.events.get()
        assert first.token_ids
        assert engine.slots_in_use == 1
        req.cancel()
        at_cancel = len(req.generated)
        # A step takes 20 ms and the request needs 100 of them: only a cancel frees the slot this soon.
        await until(lambda: engine.slots_in_use == 0 and not engine.running, timeout=1.0)
        stopped_at = len(req.generated)
        await asyncio.sleep(0.1)
        assert len(req.generated) == stopped_at <= at_cancel + 1  # no token after the hang-up's step

    try:
        asyncio.run(run())
    finally:
        engine.stop()


def test_timeout_and_queue_limits(lm):
    engine = make_engine(lm, max_slots=1, max_queue=1, timeout_s=0.05)

    async def run() -> None:
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        first = engine.submit(lm.tokenizer.encode("a"), params)
        assert (await first.events.get()).token_ids  # admitted: the queue is empty again
        engine.submit(lm.tokenizer.encode("b"), params)
        with pytest.raises(QueueFull):
            for _ in range(5):
                engine.submit(lm.tokenizer.encode("c"), params)
        with pytest.raises(RequestTimeout):
            await collect(engine, first)
        with pytest.raises(ValueError, match="context"):
            engine.submit(lm.tokenizer.encode("a"), SamplingParams(max_tokens=10_000))

    try:
        asyncio.run(run())
    finally:
        engine.stop()


def test_a_failing_step_fails_its_requests_not_the_engine(lm, monkeypatch):
    engine = make_engine(lm)
    original = lm.model.decode_step
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(lm.model, "decode_step", flaky)

    async def run() -> None:
        bad = engine.submit(lm.tokenizer.encode("x"), SamplingParams(max_tokens=20, ignore_eos=True))
        with pytest.raises(RuntimeError, match="generation failed"):
            await collect(engine, bad)
        good = engine.submit(lm.tokenizer.encode("x"), SamplingParams(max_tokens=5, ignore_eos=True))
        ids, _, reason = await collect(engine, good)
        assert len(ids) == 5 and reason == "length"
        assert engine.slots_in_use == 0

    try:
        asyncio.run(run())
    finally:
        engine.stop()


def test_graceful_stop_drains_running_requests(lm):
    engine = slowed(make_engine(lm))
    done = {}

    async def run() -> None:
        req = engine.submit(lm.tokenizer.encode("x"), SamplingParams(max_tokens=30, ignore_eos=True))
        assert (await req.events.get()).token_ids  # running: 29 more steps of 20 ms to go
        stopper = threading.Thread(target=engine.stop)
        stopper.start()
        rest, _, done["reason"] = await collect(engine, req)
        done["ids"] = req.generated
        with pytest.raises(QueueFull):
            engine.submit(lm.tokenizer.encode("y"), SamplingParams(max_tokens=3))
        await asyncio.to_thread(stopper.join)

    asyncio.run(run())
    assert len(done["ids"]) == 30 and done["reason"] == "length"


def _reference(lm, prompts, n):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [lm_tokens(lm, p, params) for p in prompts]


def _run_all(engine, lm, prompts, n) -> list:
    async def go() -> list:
        reqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p in prompts]
        return await asyncio.gather(*(collect(engine, r) for r in reqs), return_exceptions=True)

    return asyncio.run(go())


def test_a_fault_in_one_request_leaves_the_others_identical(lm):
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(8, seed=1)]
    reference = _reference(lm, prompts, 12)
    assert_varied(reference)
    engine = make_engine(lm)
    victim = prompts[3]
    steps = {"n": 0}

    def hook(req) -> None:
        if req.prompt_ids == victim:
            steps["n"] += 1
            if steps["n"] == 4:
                raise RuntimeError("injected")

    engine.fault_hook = hook
    try:
        results = _run_all(engine, lm, prompts, 12)
    finally:
        engine.stop()
    for i, (result, ref) in enumerate(zip(results, reference, strict=True)):
        if i == 3:
            assert isinstance(result, RuntimeError) and "generation failed" in str(result)
        else:
            assert result[0] == ref
    assert engine.slots_in_use == 0


def test_out_of_memory_is_reported_as_such(lm):
    engine = make_engine(lm)

    def hook(req) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    engine.fault_hook = hook
    try:
        (result,) = _run_all(engine, lm, [lm.tokenizer.encode("x")], 4)
    finally:
        engine.stop()
    assert isinstance(result, OutOfMemory)


def test_a_failing_batch_forward_is_retried_one_by_one(lm, monkeypatch):
    """A forward that fails whenever one poisoned request is in the batch: the others finish identical
    to a clean run, the poisoned one fails."""
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(6, seed=2)]
    reference = _reference(lm, prompts, 10)
    assert_varied(reference)
    engine = make_engine(lm)
    original = lm.model.decode_step
    poisoned: dict[str, int] = {}

    def decode_step(tokens, positions, cache, slots, kv_len=None):
        slots, positions = (t.tolist() if isinstance(t, torch.Tensor) else t for t in (slots, positions))
        if poisoned.get("slot") in slots and max(positions) > len(prompts[2]) + 3:
            raise RuntimeError("poisoned batch")
        return original(tokens, positions, cache, slots, kv_len=kv_len)

    monkeypatch.setattr(lm.model, "decode_step", decode_step)

    async def go() -> list:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        reqs = [engine.submit(p, params) for p in prompts]
        await asyncio.sleep(0)
        results = asyncio.gather(*(collect(engine, r) for r in reqs), return_exceptions=True)
        for _ in range(200):
            if reqs[2].slot >= 0:
                poisoned["slot"] = reqs[2].slot
                break
            await asyncio.sleep(0.001)
        return await results

    try:
        results = asyncio.run(go())
    finally:
        engine.stop()
    assert isinstance(results[2], RuntimeError)
    assert [r[0] for i, r in enumerate(results) if i != 2] == [ref for i, ref in enumerate(reference) if i != 2]


def test_the_engine_loop_restarts_when_it_dies(lm, monkeypatch):
    engine = make_engine(lm)
    original = engine.step
    calls = {"n": 0}

    def dying_step() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise SystemError("loop crash")  # outside the per-request isolation
        original()

    monkeypatch.setattr(engine, "step", dying_step)
    try:
        first = _run_all(engine, lm, [lm.tokenizer.encode("first")], 20)
        second = _run_all(engine, lm, [lm.tokenizer.encode("second")], 5)
    finally:
        engine.stop()
    assert isinstance(first[0], RuntimeError) and engine.restarts == 1
    assert len(second[0][0]) == 5


# --------------------------------------------------------------------------------------------------
# Dynamic batcher
# --------------------------------------------------------------------------------------------------
def test_batcher_batches_and_isolates_failures():
    seen: list[int] = []

    def batch_fn(items: list[int]) -> list:
        seen.append(len(items))
        time.sleep(0.01)
        return [ValueError(f"bad {x}") if x < 0 else x * 2 for x in items]

    batcher = DynamicBatcher("b", batch_fn, max_batch_size=4, max_wait_ms=20, max_queue=100, metrics=Metrics())
    batcher.start()

    async def run() -> list:
        return await asyncio.gather(*(batcher.submit(x) for x in [1, 2, -3, 4, 5, 6, 7, 8, 9]),
                                    return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        batcher.stop()
    assert results[:2] == [2, 4] and results[3:] == [8, 10, 12, 14, 16, 18]
    assert isinstance(results[2], ValueError)
    assert max(seen) <= 4 and sum(seen) == 9 and len(seen) < 9  # batched, never above the limit


def test_an_item_on_an_idle_batcher_does_not_wait_for_a_batch_but_items_under_load_do():
    """--batch-max-wait-ms is a wait for more items while they keep coming: a lone request on an idle
    batcher runs at once (the minute-long wait never starts), while items that queued up behind a running
    batch wait for the batch to fill."""
    gate, inside, seen = threading.Event(), threading.Event(), []

    def batch_fn(items: list[int]) -> list[int]:
        seen.append(list(items))
        if items == [0]:
            inside.set()
            gate.wait(5)
        return items

    batcher = DynamicBatcher("b", batch_fn, max_batch_size=4, max_wait_ms=60_000, max_queue=10, metrics=Metrics())
    batcher.start()

    async def run() -> None:
        assert await asyncio.wait_for(batcher.submit(7), 5) == 7  # alone, idle: no 60 s wait
        blocker = asyncio.ensure_future(batcher.submit(0))
        assert await asyncio.to_thread(inside.wait, 5)  # the worker is inside the batch of item 0
        queued = [asyncio.ensure_future(batcher.submit(x)) for x in (1, 2, 3)]
        await asyncio.sleep(0.05)  # 1, 2 and 3 are queued behind the running batch
        gate.set()
        await asyncio.sleep(0.1)  # 1, 2 and 3 wait for the batch to fill (were 4 later still, it would join)
        queued.append(asyncio.ensure_future(batcher.submit(4)))
        assert await asyncio.wait_for(asyncio.gather(blocker, *queued), 5) == [0, 1, 2, 3, 4]

    try:
        asyncio.run(run())
    finally:
        gate.set()
        batcher.stop()
    assert seen == [[7], [0], [1, 2, 3, 4]]


def test_batcher_queue_limit():
    gate = threading.Event()
    batcher = DynamicBatcher("b", lambda items: (gate.wait(5), items)[1], max_batch_size=1, max_wait_ms=0,
                             max_queue=2, metrics=Metrics())
    batcher.start()

    async def run() -> int:
        first = batcher.enqueue([1])  # taken by the worker, which then blocks
        await until(lambda: batcher.running and not batcher.waiting)
        batcher.enqueue([2, 3])  # one request of two items: it waits as one
        batcher.enqueue([4])
        with pytest.raises(QueueFull):
            batcher.enqueue([5])
        gate.set()
        return await asyncio.wait_for(batcher.result(first[0]), 5)

    try:
        assert asyncio.run(run()) == 1
    finally:
        gate.set()
        batcher.stop()


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens(lm):
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(4, seed=3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run(engine) -> list:
        reqs = [engine.submit(p, params) for p in prompts]
        return [ids for ids, _, _ in await asyncio.gather(*(collect(engine, r) for r in reqs))]

    outputs = []
    for compiled in (False, True):
        engine = make_engine(lm, compile=compiled)
        assert hasattr(engine.runner._compiled, "_torchdynamo_orig_callable") == compiled
        try:
            outputs.append(asyncio.run(run(engine)))
        finally:
            engine.stop()
    assert_varied(outputs[0])
    assert outputs[1] == outputs[0]


def test_worker_threads_make_the_models_gpu_their_current_device(lm, monkeypatch):
    """CUDA keeps a current device per thread: the engine and batcher threads select the model's (cuda:1
    here), or Triton launches and graph capture would go to device 0. Recorded without a GPU."""
    chosen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append((threading.current_thread().name, d)))
    gpu = torch.device("cuda:1")
    engine = make_engine(lm)  # started on the CPU: the thread selects nothing
    engine.stop()
    engine = Worker("gpu-engine", max_queue=1, timeout_s=1.0, metrics=Metrics(), capacity=1)
    engine.device = gpu
    engine.start()
    batcher = DynamicBatcher("gpu-batcher", lambda items: items, max_batch_size=1, max_wait_ms=0, max_queue=1,
                             metrics=Metrics(), device=gpu)
    batcher.start()
    for _ in range(100):
        if len(chosen) == 2:
            break
        time.sleep(0.01)
    engine.stop(drain_timeout_s=0)
    batcher.stop(drain_timeout_s=0)
    assert sorted(chosen) == [("batcher-gpu-batcher", gpu), ("engine-gpu-engine", gpu)]


def test_batcher_survives_a_waiter_cancelled_mid_batch_and_drops_abandoned_items():
    """A waiter cancelled while its batch runs (Ray Serve and `wait_for` cancel handlers) must not kill the
    worker thread; items whose waiters left while queued are not computed."""
    started, release, calls = threading.Event(), threading.Event(), []

    def batch_fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        started.set()
        release.wait(5)
        return [x * 10 for x in items]

    batcher = DynamicBatcher("b", batch_fn, max_batch_size=2, max_wait_ms=0, max_queue=10, metrics=Metrics())
    batcher.start()

    async def run() -> None:
        running = asyncio.create_task(batcher.submit(1))
        await asyncio.to_thread(started.wait, 5)
        queued = [asyncio.create_task(batcher.submit(x)) for x in (2, 3)]
        await asyncio.sleep(0.05)
        for task in [running, *queued]:
            task.cancel()
        await asyncio.gather(running, *queued, return_exceptions=True)
        release.set()
        assert await asyncio.wait_for(batcher.submit(4), timeout=5) == 40  # the worker is alive

    try:
        asyncio.run(run())
    finally:
        batcher.stop()
    assert calls == [[1], [4]]


def test_a_long_context_model_gets_a_cache_of_the_default_context(tmp_path):
    """Without --max-model-len a 32k-context model serves 4096 positions, and says so; with it, what it asks for.
    Without --kv-cache-memory the pool holds every row's whole context (and the null block)."""
    import json

    d = factories.hf_family_dir("qwen2", tmp_path / "qwen2")
    raw = json.loads((d / "config.json").read_text()) | {"max_position_embeddings": 32768}
    (d / "config.json").write_text(json.dumps(raw))
    loaded = checkpoint.load(d)
    assert loaded.config.max_seq_len == 32768
    for asked, served in ((None, 4096), (6000, 6000)):
        metrics = Metrics()
        engine = GenerationEngine("qwen2", loaded, metrics=metrics, max_slots=2, max_queue=4, max_model_len=asked,
                                  timeout_s=60.0)
        assert engine.max_len == served and engine.runner.cache.max_len == served
        per_token = 2 * loaded.config.n_layers * 2 * loaded.config.d_head * 4  # 2 kv heads, float32
        assert engine.runner.cache.bytes_per_token() == per_token
        values = dict(line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if line[0] != "#")
        assert float(values['tserve_kv_cache_bytes_per_token{model="qwen2"}']) == per_token
        assert float(values['tserve_kv_cache_bytes{model="qwen2"}']) == per_token * (2 * served + 16)
        assert float(values['tserve_kv_cache_blocks_total{model="qwen2"}']) == 2 * served // 16
