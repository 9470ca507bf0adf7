"""Asynchronous scheduling: the engine launches a step before it reads the tokens of the step before, and its
streams are the synchronous engine's, event for event, for every sampling and stopping option, structured
output, speculative steps, preemption and cancellation. On the CPU the device work runs in the launch, so the
order is what is tested here; `tests/engine/test_gpu.py` runs the same comparison where the device runs beside
the host. Each test runs on each way the language model is loaded (`factories.LM_LOADS`: its layers' own steps,
and the fused step `tserve serve` runs on a CPU, float32 and Q4_0)."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts
from tests.helpers.sampling_options import events, option_jobs
from tserve.model.decoding import SamplingParams, Speculation
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module", params=list(factories.LM_LOADS))
def lm(request, tmp_path_factory):
    return factories.tiny_lm_loaded(tmp_path_factory.mktemp("async-engine"), request.param)


def engine_of(lm, mode: str, **kw) -> GenerationEngine:  # noqa: ANN001
    engine = GenerationEngine("lm", lm, metrics=Metrics(), async_scheduling=mode,
                              **({"max_slots": 8, "max_queue": 64, "max_model_len": 128, "timeout_s": 120.0,
                                  "kv_block_size": 4} | kw))
    engine.start()
    return engine


def counting_rows(engine: GenerationEngine) -> list[int]:
    """The rows of each decode step the engine launches, and whether steps were on their way then."""
    launched = []
    decode = engine.runner.decode

    def counted(seqs):  # noqa: ANN001, ANN202
        launched.append((len(seqs), len(engine._in_flight)))
        return decode(seqs)

    engine.runner.decode = counted
    return launched


def test_every_option_streams_what_the_synchronous_engine_streams(lm):
    """Greedy, seeded sampling, logprobs, stop strings, min_tokens, bias, penalties, ignore_eos and two grammars,
    18 rows in one batch of 8: the same events, and the steps really overlap (launched with a step unread)."""
    sync = engine_of(lm, "off")
    jobs = option_jobs(lm, sync)
    expected = events(sync, jobs)
    overlapped = engine_of(lm, "on")
    launched = counting_rows(overlapped)
    got = events(overlapped, option_jobs(lm, overlapped))
    for (_, sp), a, b in zip(jobs, expected, got, strict=True):
        assert a == b, sp
    assert len({str(e) for e in expected}) > len(expected) * 0.6  # the options change what is written
    assert any(in_flight for _, in_flight in launched)
    assert overlapped.runner.blocks.num_in_use == 0


def test_a_request_ended_by_max_tokens_is_not_stepped_again_and_one_ended_by_eos_is_once(lm):
    """Row counts of every decode step: ended by max_tokens (known on the host), the overlapped engine steps
    exactly the rows the synchronous one does; a request ended by eos (known only once its token is read) is
    stepped once more, and that row's token never reaches its stream."""
    prompts = [lm.tokenizer.encode(t) for t in cycle_prompts(4, seed=32)]
    eos = lm.tokenizer.eos_id
    by_length = [(p, SamplingParams(max_tokens=5 + i, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
    by_eos = [(p, SamplingParams(max_tokens=20, temperature=0.0, min_tokens=2 + i, logit_bias={eos: 60.0}))
              for i, p in enumerate(prompts)]
    rows = {}
    for mode in ("off", "on"):
        for name, jobs in (("length", by_length), ("eos", by_eos)):
            engine = engine_of(lm, mode)
            launched = counting_rows(engine)
            streams = events(engine, jobs)
            rows[mode, name] = sum(n for n, _ in launched), streams, engine.m.generated_tokens._value.get()
    assert rows["on", "length"] == rows["off", "length"]
    assert [len(s[-1][1]) for s in rows["off", "eos"][1]] == [2, 3, 4, 5]  # eos right after min_tokens
    assert rows["on", "eos"][1] == rows["off", "eos"][1]
    assert rows["on", "eos"][0] == rows["off", "eos"][0] + len(prompts)
    # every token chosen counts, each eos too, the dropped rows' not
    assert rows["on", "eos"][2] == rows["off", "eos"][2] == sum(len(s[-1][1]) + 1 for s in rows["off", "eos"][1])


def test_preemption_speculation_and_cancelled_clients_stream_what_the_synchronous_engine_streams(lm):
    """A pool so small that requests are preempted (their unread tokens read first), prompt-lookup drafts, and
    clients leaving mid-stream: the same events as the synchronous engine, every block back."""
    jobs = option_jobs(lm, engine_of(lm, "off"))
    block_bytes = 4 * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    small = {"max_slots": 6, "kv_cache_budget": (20 * block_bytes, None), "max_model_len": 96}
    for kw, cancel in ((small, None), ({"speculation": Speculation(num_tokens=3)}, None),
                       ({}, {1: 2, 4: 1, 9: 3, 14: 5})):
        sync, overlapped = engine_of(lm, "off", **kw), engine_of(lm, "on", **kw)
        expected = events(sync, jobs, cancel)
        assert events(overlapped, jobs, cancel) == expected, kw
        assert overlapped.runner.blocks.num_in_use == 0 == overlapped.runner.slots.num_used
        if "kv_cache_budget" in kw:
            assert overlapped.m.preemptions._value.get() > 0


def test_blocks_filled_by_tokens_fed_from_the_device_are_found_by_a_follow_up_prompt(lm):
    """A conversation's next turn (prompt + answer + more) reads the blocks its answer filled, though the
    overlapped engine computed them before it knew their tokens."""
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=33, min_words=6, max_words=6)[0])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = engine_of(lm, "on")
    first = events(engine, [(prompt, params)])[0]
    answer = first[-1][1]
    follow_up = prompt + answer + lm.tokenizer.encode(" and", add_special_tokens=False)
    engine = engine_of(lm, "on")

    async def run() -> tuple:
        a = engine.submit(prompt, params)
        async for _ in engine.stream(a):
            pass
        b = engine.submit(follow_up, SamplingParams(max_tokens=2, temperature=0.0))
        async for _ in engine.stream(b):
            pass
        return a, b

    try:
        _, b = asyncio.run(run())
    finally:
        engine.stop()
    # every full block of prompt + answer but the one holding the last answer token, never fed
    assert b.cached_tokens == (len(prompt) + len(answer) - 1) // 4 * 4 > len(prompt) + 8
