"""The paged KV cache and its block pool, on the trained fixture LM: block names chain their predecessors, a
cached prefix is read (not recomputed) and gives the logits a computation from scratch gives, a block is
never handed out while a table holds it, and the cache's reads through block tables equal the static
layout's."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts
from tserve.model import checkpoint
from tserve.model.block_pool import BlockPool
from tserve.model.decoding import DecoderRunner, SamplingParams, TextSequence

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BS = 4  # small blocks: short prompts span several


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("paged-lm")), device="cpu")


def runner_of(lm, *, num_blocks: int | None = None, prefix_caching: bool = True, num_slots: int = 4):  # noqa: ANN001
    return DecoderRunner(lm, num_slots=num_slots, max_len=96, cuda_graphs=False, num_blocks=num_blocks,
                         block_size=BS, prefix_caching=prefix_caching)


def prompt_ids(lm, text: str) -> list[int]:  # noqa: ANN001
    return lm.tokenizer.encode(text)


def run(runner: DecoderRunner, seqs: list[TextSequence], steps: int) -> list[torch.Tensor]:
    """Admit, prefill and decode `steps` greedy tokens; the logits of every step (B, V) (rows stay admitted)."""
    for s in seqs:
        assert runner.admit(s)
    logits = [runner.prefill(seqs)]
    for _ in range(steps):
        tokens, _ = runner.choose(seqs, logits[-1])
        for s, t in zip(seqs, tokens, strict=True):
            s.next_token = t
            s.generated.append(t)
            assert runner.grow(s)
        logits.append(runner.decode(seqs))
    return logits


def fresh(lm, ids: list[int], steps: int = 6) -> list[torch.Tensor]:  # noqa: ANN001
    """The reference: one sequence in a runner of its own, nothing cached."""
    seq = TextSequence(ids, SamplingParams(max_tokens=64, temperature=0.0))
    return run(runner_of(lm, prefix_caching=False), [seq], steps)


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in zip(a, b, strict=True))


def test_a_cached_prefix_is_shared_and_gives_the_logits_of_a_fresh_computation(lm):
    """B's prompt starts with A's first blocks: B's table maps them (no recompute, A's very blocks) and B's
    prefill and decode logits equal B computed alone; a prompt that shares nothing maps nothing."""
    shared = prompt_ids(lm, cycle_prompts(1, seed=3, min_words=12, max_words=12)[0])
    a_ids, b_ids = shared + prompt_ids(lm, " red"), shared + prompt_ids(lm, " one two")
    runner = runner_of(lm)
    a = TextSequence(a_ids, SamplingParams(max_tokens=64, temperature=0.0))
    run(runner, [a], 3)
    runner.release(a)  # A's named blocks stay cached after it is gone
    b = TextSequence(b_ids, SamplingParams(max_tokens=64, temperature=0.0))
    b_logits = run(runner, [b], 6)
    full = len(shared) // BS
    assert b.table.num_cached_tokens == b.cached_tokens == full * BS > 0
    assert b.table.blocks[:full] == [runner.blocks._by_name[n] for n in b.table.hashes[:full]]
    assert close(b_logits, fresh(lm, b_ids))
    c = TextSequence(prompt_ids(lm, " zebra" * 3 + " ".join(["x"] * 10)), SamplingParams(max_tokens=4))
    assert runner.admit(c) and c.cached_tokens == 0


def test_a_block_is_named_after_its_whole_prefix_not_its_own_tokens(lm):
    """A = P Q, C = X R are cached; B = X Q must find X only: A's copy of Q was computed after P, and read
    after X it would give B other logits than its own."""
    words = cycle_prompts(3, seed=9, min_words=8, max_words=8)
    blocks = [prompt_ids(lm, w)[: 2 * BS] for w in words]  # three prefixes of two blocks each
    p, x, q = blocks
    runner = runner_of(lm)
    for ids in (p + q + [5], x + p + [5]):
        seq = TextSequence(ids, SamplingParams(max_tokens=8, temperature=0.0))
        run(runner, [seq], 1)
        runner.release(seq)
    b_ids = x + q + [5]
    b = TextSequence(b_ids, SamplingParams(max_tokens=8, temperature=0.0))
    b_logits = run(runner, [b], 4)
    assert b.cached_tokens == len(x)  # X's two blocks, not Q's
    assert close(b_logits, fresh(lm, b_ids, 4))


def test_a_block_held_by_a_table_is_never_handed_out(lm):
    """A and B share a prefix; A leaves; C, with nothing in common, then takes every block the pool calls free.
    B's logits stay those of B alone: none of its blocks went to C."""
    shared = prompt_ids(lm, cycle_prompts(1, seed=4, min_words=12, max_words=12)[0])
    a_ids, b_ids = shared + prompt_ids(lm, " red"), shared + prompt_ids(lm, " green")
    runner = runner_of(lm, num_blocks=25)
    a = TextSequence(a_ids, SamplingParams(max_tokens=64, temperature=0.0))
    run(runner, [a], 1)
    b = TextSequence(b_ids, SamplingParams(max_tokens=64, temperature=0.0))
    assert runner.admit(b) and b.cached_tokens > 0
    logits = [runner.prefill([b])]
    runner.release(a)
    filler = [t for text in cycle_prompts(20, seed=11) for t in prompt_ids(lm, text)]
    c = TextSequence(filler[: runner.blocks.num_free * BS], SamplingParams(max_tokens=1, temperature=0.0))
    assert runner.admit(c) and runner.blocks.num_free == 0
    runner.prefill([c])  # C writes every block it was given
    assert not set(c.table.blocks) & set(b.table.blocks)
    runner.release(c)
    for _ in range(5):
        (t,), _ = runner.choose([b], logits[-1])
        b.next_token = t
        b.generated.append(t)
        assert runner.grow(b)
        logits.append(runner.decode([b]))
    assert close(logits, fresh(lm, b_ids, 5))
    runner.release(b)
    assert runner.blocks.num_in_use == 0 and all(runner.blocks.refs(i) == 0 for i in range(runner.blocks.num_blocks))


def test_scattered_block_tables_read_what_a_static_cache_reads(lm):
    """Three sequences in a pool whose blocks were handed out out of order (other sequences came and went)
    give, step by step, the logits each gives alone in a static layout."""
    prompts = [prompt_ids(lm, t) for t in cycle_prompts(3, seed=6)]
    runner = runner_of(lm, prefix_caching=False)
    for text in cycle_prompts(4, seed=12):  # churn: the free list ends up out of order
        seq = TextSequence(prompt_ids(lm, text), SamplingParams(max_tokens=4))
        assert runner.admit(seq)
        runner.release(seq)
    seqs = [TextSequence(p, SamplingParams(max_tokens=64, temperature=0.0)) for p in prompts]
    together = run(runner, seqs, 8)
    for i, p in enumerate(prompts):
        alone = fresh(lm, p, 8)
        assert close([step[i : i + 1] for step in together], alone)


def test_the_pool_evicts_the_least_recently_freed_named_block_and_forgets_its_name():
    pool = BlockPool(5, 2)
    tables = [pool.admit(ids) for ids in ([1, 2, 9], [3, 4, 9])]
    for t, ids in zip(tables, ([1, 2, 9], [3, 4, 9]), strict=True):
        pool.name_full_blocks(t, ids[:2])
        pool.release(t)
    assert pool.num_free == 4 and pool.num_cached_free == 2
    assert pool.cached_prefix([1, 2, 7])[0] and pool.cached_prefix([3, 4, 7])[0]
    taken = pool.admit([8, 8, 8, 8, 8])  # three blocks: the two unnamed ones, then the oldest named ([1, 2])
    assert not pool.cached_prefix([1, 2, 7])[0] and pool.cached_prefix([3, 4, 7])[0]
    assert pool.num_free == 1 and not pool.can_admit([3, 4, 6])  # its hit is the one free block: one short
    pool.release(taken)
    again = pool.admit([3, 4, 6])  # a hit on a free block takes it back
    assert again.num_cached_tokens == 2 and pool.refs(again.blocks[0]) == 1 and pool.num_free == 2
    with pytest.raises(RuntimeError, match="released more often"):
        pool._refs[1] = 0
        pool.release(type(taken)([1]))


def test_a_freed_block_holding_nothing_worth_keeping_is_taken_before_a_named_one_freed_earlier():
    """A block no prefix names (a partial last block) goes to the front of the free list, whenever it is freed:
    new content takes it, and the never-used ones, before it evicts a cached prefix."""
    pool = BlockPool(4, 2)  # three usable blocks
    named = pool.admit([1, 2])
    pool.name_full_blocks(named, [1, 2])
    pool.release(named)
    pool.release(pool.admit([5]))  # one token: a partial block, freed after the named one
    pool.admit([7, 7, 7, 7])  # two blocks
    assert pool.cached_prefix([1, 2, 3])[0] and pool.num_cached_free == 1


def test_a_request_larger_than_the_pool_is_refused_before_it_runs(lm):
    runner = runner_of(lm, num_blocks=11)
    runner.check(20, 20)  # 10 blocks: fits
    with pytest.raises(ValueError, match="needs 11 KV-cache blocks"):
        runner.check(21, 20)


def test_a_forked_table_shares_its_full_blocks_and_copies_the_last_partial_one():
    """A beam taking its parent's cache: the full blocks are the parent's (counted twice), the partial last one
    is a block of its own to be filled with the parent's content (both write into it next); at a block boundary
    nothing is copied. Released, every block is free again."""
    pool = BlockPool(10, 4)
    parent = pool.admit(list(range(1, 11)))  # 10 positions: blocks of 4, 4 and 2
    child, copy = pool.fork(parent, 10)
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] not in parent.blocks
    assert copy == (parent.blocks[2], child.blocks[2], 2)  # two positions written in it
    assert [pool.refs(b) for b in parent.blocks] == [2, 2, 1]
    even, none = pool.fork(parent, 8)
    assert even.blocks == parent.blocks[:2] and none is None
    for table in (parent, child, even):
        pool.release(table)
    assert pool.num_in_use == 0 and pool.num_free == pool.num_usable
