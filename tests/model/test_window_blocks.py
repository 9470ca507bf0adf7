"""The sliding-window layers' own blocks (`model.window_blocks`): a sequence holds there only the blocks its window
still reaches, the steps compute what they compute with every position kept, a cached prefix counts only as far as
its last window is still held, and every block comes back."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts
from tserve.model import checkpoint
from tserve.model.block_pool import NULL_BLOCK
from tserve.model.decoding import DecoderRunner, SamplingParams, TextSequence
from tserve.model.window_blocks import WindowBlocks

# The outcome depends on the CPU's kernels (the fused decode step reads the sliding layers' own cache): `make
# test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BS = 4


def load_family(family: str, directory):  # noqa: ANN001, ANN201
    return checkpoint.load(factories.hf_family_dir(family, directory), device="cpu", pack_weights=True,
                           fused_layers=True)  # as served


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 3: its first layer attends within 16 positions (with a rope base of its own), the second globally."""
    loaded = load_family("gemma3", tmp_path_factory.mktemp("gemma3"))
    assert loaded.config.sliding_layers == [0] and loaded.config.sliding_window == 16
    return loaded


def runner_of(loaded, *, window_blocks: int | None = None, num_slots: int = 3, **kw) -> DecoderRunner:  # noqa: ANN001
    return DecoderRunner(loaded, num_slots=num_slots, max_len=96, cuda_graphs=False, block_size=BS,
                         window_blocks=window_blocks, **kw)


def long_prompts(loaded, n: int, seed: int) -> list[list[int]]:  # noqa: ANN001
    """`n` prompts of 20-45 tokens: past the window of 16, each a different length."""
    texts = cycle_prompts(n, seed=seed, min_words=12, max_words=20)
    return [loaded.tokenizer.encode(t)[:20 + 9 * i] for i, t in enumerate(texts)]


def step_logits(runner: DecoderRunner, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list]:
    """Admit and prefill `prompts` together, then `steps` greedy decode steps: every step's logits, and the
    sequences (still admitted)."""
    seqs = [TextSequence(p, SamplingParams(max_tokens=64, temperature=0.0)) for p in prompts]
    for s in seqs:
        assert runner.admit(s)
    logits = [runner.prefill(seqs)]
    for _ in range(steps):
        for s, t in zip(seqs, runner.choose(seqs, logits[-1])[0], strict=True):
            s.next_token = t
            s.generated.append(t)
            assert runner.grow(s)
        logits.append(runner.decode(seqs))
    return logits, seqs


def held(table) -> int:  # noqa: ANN001
    return sum(b != NULL_BLOCK for b in table.blocks)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "layer-by-layer"])
@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_steps_equal_those_of_a_cache_that_keeps_every_position_and_hold_only_the_window(gemma, tmp_path, family,
                                                                                         fused):
    """Three prompts of 20-38 tokens prefilled together, then 30 greedy steps (to 68 positions: four of Gemma 3's
    windows of 16, past Phi-3's of 48): every step's logits equal those of the one pool that keeps every position
    (`window_blocks=0`), bitwise; each sequence holds in the sliding layers' pool only the blocks its window
    reaches, and the other layers' cache holds the global layers only (Gemma 3: one of two; Phi-3, whose layers
    all slide: none)."""
    loaded = gemma if family == "gemma3" else load_family(family, tmp_path / family)
    fused_step = loaded.model.fused
    assert fused_step is not None, "the fixture's steps fuse where the kernels are built"
    loaded.model.fused = fused_step if fused else None
    try:
        prompts = long_prompts(loaded, 3, seed=41)
        windowed, kept = runner_of(loaded), runner_of(loaded, window_blocks=0)
        n_sliding = len(loaded.config.sliding_layers)
        assert windowed.cache.local.k.size(0) == n_sliding and kept.cache.local is None
        assert windowed.cache.k.size(0) == loaded.config.n_layers - n_sliding == (1 if family == "gemma3" else 0)
        ours, seqs = step_logits(windowed, prompts, 30)
        theirs, _ = step_logits(kept, prompts, 30)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
        per_row = -(-loaded.config.sliding_window // BS) + 1
        for s in seqs:
            assert len(s.window_table.blocks) == len(s.table.blocks) and held(s.window_table) <= per_row
        assert held(seqs[-1].window_table) < len(seqs[-1].table.blocks)  # the longest gave blocks back
        assert windowed.windows.pool.num_in_use == sum(held(s.window_table) for s in seqs) <= 3 * per_row
        for s in seqs:
            windowed.release(s)
        assert windowed.windows.pool.num_in_use == 0 == windowed.blocks.num_in_use
    finally:
        loaded.model.fused = fused_step


def test_a_cached_prefix_counts_as_far_as_its_last_window_is_held(gemma):
    """A prompt computed and released leaves its blocks named in both pools: the same prompt again reads all its
    full blocks and gives the logits of a fresh computation. Once the sliding pool has handed the prefix's last
    window to other sequences, the hit is cut back to where a window is still held (here: nothing), and the logits
    are still those of a fresh computation."""
    prompt = long_prompts(gemma, 4, seed=43)[3]  # 47 tokens: 11 full blocks before its last token
    fresh, _ = step_logits(runner_of(gemma, prefix_caching=False), [prompt], 4)
    runner = runner_of(gemma, window_blocks=16)
    _, (first,) = step_logits(runner, [prompt], 4)
    runner.release(first)
    again, (second,) = step_logits(runner, [prompt], 4)
    assert second.cached_tokens == 11 * BS
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(again, fresh, strict=True))
    assert second.window_table.blocks[:second.cached_tokens // BS - 4] == [NULL_BLOCK] * 7  # never needed
    runner.release(second)
    _, seqs = step_logits(runner, long_prompts(gemma, 2, seed=44), 0)  # take the sliding pool's free blocks
    for s in seqs:
        runner.release(s)
    third_logits, (third,) = step_logits(runner, [prompt], 4)
    assert third.cached_tokens < second.cached_tokens
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(third_logits, fresh, strict=True))
    runner.release(third)
    assert runner.windows.pool.num_in_use == 0 == runner.blocks.num_in_use


def test_no_pool_of_their_own_where_it_would_hold_no_less(gemma, tmp_path):
    """One row (its prompt's blocks are all held while it is computed), or a window no shorter than the context
    (Phi-4-mini's 262,144 against 131,072): the sliding layers stay in the one pool, and nothing is reserved for
    them out of `--kv-cache-memory`."""
    from tserve.service.engine.kv_memory import lm_kv_blocks

    assert runner_of(gemma).windows is not None
    assert runner_of(gemma, num_slots=1).windows is None and runner_of(gemma, num_slots=1).cache.local is None
    assert WindowBlocks.pool_blocks(8, 32768, 262144, 16) == 0 < WindowBlocks.pool_blocks(8, 32768, 512, 16)
    num_blocks, window_blocks = lm_kv_blocks(gemma, (None, None), BS, 1, 96)
    assert window_blocks == 0 and num_blocks == 1 + 96 // BS


def test_usable_prefix_needs_every_block_of_the_window_before_the_hit():
    """Window 10, blocks of 4: a hit of h blocks needs blocks (4h - 9) // 4 .. h - 1 held. A sequence of 40 tokens
    keeps blocks 7..9 (its next query's window) and gives back 0..6, which keep their names; once block 6 is
    taken for other tokens, a 9-block hit (needing 6..8) and the 8- and 7-block ones are cut back to 6 blocks
    (needing 3..5)."""
    pool = WindowBlocks(16, 4, 10, prefix_caching=True, salt="")
    tokens = list(range(40))
    names = pool.pool.prefix_names(tokens)
    table = pool.admit(tokens, names, 0)
    assert held(table) == 10
    assert pool.computed(table, 40, lambda: tokens)
    assert held(table) == 3 and table.blocks[:7] == [NULL_BLOCK] * 7
    pool.release(table)
    assert pool.pool.num_in_use == 0
    assert pool.usable_prefix(names, tokens, 9) == 9  # every named block still there
    # The free blocks go in order: the 5 never used, then those given back, block 6 of the sequence first.
    other = pool.pool.admit(list(range(100, 124)))
    assert len(other.blocks) == 6
    assert pool.usable_prefix(names, tokens, 9) == 6
    again = pool.admit(tokens, names, 6)  # blocks 3..5 shared, then new ones
    assert again.blocks[:3] == [NULL_BLOCK] * 3 and again.num_cached_tokens == 24 and held(again) == 7
    pool.release(again)
    pool.pool.release(other)
    assert pool.pool.num_in_use == 0


def test_usable_prefix_takes_a_hit_whose_window_is_held_to_the_block():
    """Window 10, blocks of 4: a 6-block hit needs blocks 3..5 and no more, so a block missing before them (2)
    leaves it whole; one missing inside them (3) cuts it to the 3-block hit, which needs 0..2."""
    pool = WindowBlocks(16, 4, 10, prefix_caching=True, salt="")
    tokens = list(range(40))
    names = pool.pool.prefix_names(tokens)
    table = pool.admit(tokens, names, 0)
    pool.computed(table, 40, lambda: tokens)
    pool.release(table)
    unknown = b"\0" * len(names[0])  # a name no block holds: as if that block had been taken for other tokens
    assert pool.usable_prefix([*names[:2], unknown, *names[3:]], tokens, 6) == 6
    assert pool.usable_prefix([*names[:2], unknown, *names[3:]], tokens, 9) == 9
    assert pool.usable_prefix([*names[:3], unknown, *names[4:]], tokens, 6) == 3



def test_asynchronous_steps_on_sliding_layers_stream_the_same_and_name_both_pools_blocks(gemma):
    """The engine launching each step before it reads the last one's tokens (`--async-scheduling on`) on a model
    with sliding layers and their own pool: the streams of the synchronous engine, and a follow-up prompt (prompt +
    answer + more) finds the blocks the answer filled, in both pools, before their tokens were known."""
    import asyncio

    from tserve.service.engine import GenerationEngine
    from tserve.service.metrics import Metrics

    prompts = long_prompts(gemma, 3, seed=45)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(mode: str) -> tuple[list[list[int]], int]:
        engine = GenerationEngine("g", gemma, metrics=Metrics(), max_slots=3, max_queue=8, max_model_len=96,
                                  timeout_s=60.0, kv_block_size=BS, async_scheduling=mode)
        engine.start()

        async def go() -> tuple[list[list[int]], int]:
            reqs = [engine.submit(p, params) for p in prompts]
            for r in reqs:
                async for _ in engine.stream(r):
                    pass
            follow = engine.submit(prompts[0] + reqs[0].generated + [5, 6], SamplingParams(max_tokens=2))
            async for _ in engine.stream(follow):
                pass
            return [r.generated for r in reqs], follow.cached_tokens

        try:
            return asyncio.run(go())
        finally:
            engine.stop()

    synchronous, overlapped = run("off"), run("on")
    assert overlapped == synchronous
    assert overlapped[1] == (len(prompts[0]) + 24 - 1) // BS * BS  # every full block but the last answer token's
