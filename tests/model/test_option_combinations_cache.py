"""The paged KV cache where its options meet: every attention backend (math, sdpa, cpu-decode) over block sizes
of 1, an odd 5 and 16 (a context that ends inside a block), with a cached prefix and a fresh prompt prefilled
together, on a multi-head and a grouped-query model, always against the model's whole forward over the sequence;
a released prefix's eviction order; the sliding layers' own pool under a request check and speculative drafts."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts
from tserve.model import checkpoint
from tserve.model.block_pool import BlockPool
from tserve.model.decoding import DecoderRunner, SamplingParams, TextSequence
from tserve.model.decoding.speculative import Speculation
from tserve.model.layers import set_attention_backend

# The outcome depends on the CPU's kernels (cpu-decode reads the cache itself).
pytestmark = pytest.mark.kernels

MAX_LEN = 42  # a multiple of none of the block sizes below: every row's last block is a partial one


@pytest.fixture(scope="module", params=["trained-mha", "random-gqa-rope"])
def lm(request, tmp_path_factory):
    """The committed tiny LM (4 heads, learned positions), or a random one whose 4 query heads share 2 kv heads
    under rotary positions."""
    d = tmp_path_factory.mktemp(request.param)
    path = factories.tiny_lm_dir(d) if request.param == "trained-mha" else \
        factories.tiny_lm_dir(d, trained=False, n_kv_heads=2, positions="rope")
    loaded = checkpoint.load(path, device="cpu")
    if request.param == "random-gqa-rope":
        assert loaded.config.kv_heads < loaded.config.n_heads
    return loaded


def whole_forward_logits(lm, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """The reference: the model's forward over the whole sequence, no cache; the last position's logits."""
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]))[0, -1]


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("backend", ["math", "sdpa", "cpu-decode"])
def test_steps_over_a_shared_prefix_and_a_fresh_prompt_equal_the_whole_forward_for_each_backend_and_block_size(
        lm, backend, block_size):
    """A prompt is computed and released (its blocks stay named); a prompt sharing its first tokens and an
    unrelated one are then prefilled together (one row from its cached prefix on, one from position 0), and
    decoded greedily until the longer reaches the context's last position, which lies inside a partial block.
    Every prefill and step logit equals the whole forward's, whatever the backend: the math and sdpa steps
    attend over a gathered copy bounded by the step's positions, cpu-decode reads the blocks in place."""
    served = lm.model.blocks[0].attn.backend
    set_attention_backend(lm.model, backend)
    try:
        texts = cycle_prompts(3, seed=5, min_words=12, max_words=14)
        first, other = (lm.tokenizer.encode(t)[:18] for t in texts[:2])
        shared = first[:16] + lm.tokenizer.encode(texts[2])[:5]
        assert len(first) == len(other) == 18 and len(shared) == 21
        runner = DecoderRunner(lm, num_slots=3, max_len=MAX_LEN, cuda_graphs=False, block_size=block_size,
                               prefix_caching=True)
        warm = TextSequence(first, SamplingParams(max_tokens=4, temperature=0.0))
        assert runner.admit(warm)
        runner.prefill([warm])
        runner.release(warm)
        seqs = [TextSequence(p, SamplingParams(max_tokens=64, temperature=0.0)) for p in (shared, other)]
        for s in seqs:
            assert runner.admit(s)
        assert seqs[0].num_computed >= 16 // block_size * block_size > seqs[1].num_computed  # from the prefix on
        logits = runner.prefill(seqs)
        steps = MAX_LEN - len(shared)
        for step in range(steps + 1):
            for s, row in zip(seqs, logits, strict=True):
                torch.testing.assert_close(row, whole_forward_logits(lm, s.token_ids()), atol=1e-4, rtol=1e-4,
                                           msg=lambda m, s=s: f"{backend}, blocks of {block_size}, "
                                                              f"{len(s.token_ids())} positions: {m}")
            if step == steps:
                break
            for s, t in zip(seqs, runner.choose(seqs, logits)[0], strict=True):
                s.next_token = t
                s.generated.append(t)
                assert runner.grow(s)
            logits = runner.decode(seqs)
        assert max(s.num_computed for s in seqs) == MAX_LEN  # the last token fed sits at the context's last position
        for s in seqs:
            runner.release(s)
        assert runner.blocks.num_in_use == 0
    finally:
        set_attention_backend(lm.model, served)


def test_a_released_prefix_gives_up_its_last_blocks_before_its_first():
    """A released sequence's blocks are queued for eviction last block first: new content that needs one named
    block takes the prefix's tail, and the same prompt again still reads its head from the cache (evicting the
    head first would leave the whole chain unreadable, since each block's name depends on those before it)."""
    pool = BlockPool(6, 2)  # five usable blocks
    ids = [1, 2, 3, 4, 5, 6, 9]  # three full blocks and a partial one
    table = pool.admit(ids)
    pool.name_full_blocks(table, ids[:6])
    pool.release(table)
    assert pool.num_cached_free == 3
    pool.admit([7, 7, 7, 7, 7])  # three blocks: the never-used one, the unnamed partial one, then one named
    hits, _ = pool.cached_prefix(ids)
    assert len(hits) == 2 and pool.num_cached_free == 2


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 3 as served: its first layer attends within 16 positions, the second globally."""
    loaded = checkpoint.load(factories.hf_family_dir("gemma3", tmp_path_factory.mktemp("gemma3")), device="cpu",
                             pack_weights=True, fused_layers=True)
    assert loaded.config.sliding_layers == [0] and loaded.config.sliding_window == 16
    return loaded


def test_a_request_the_sliding_layers_pool_cannot_hold_is_refused_up_front(gemma):
    """With the sliding layers in a pool of their own, a sequence being computed (a prompt, or a preempted
    sequence computed again) holds all its blocks there for a while: a request longer than that pool holds must
    be refused by `check`, however roomy the global pool, or it would wait for admission forever."""
    runner = DecoderRunner(gemma, num_slots=3, max_len=96, cuda_graphs=False, block_size=4, window_blocks=8)
    assert runner.windows is not None and runner.windows.pool.num_usable == 7 < runner.blocks.num_usable
    runner.check(20, 8)  # 7 blocks: fits both pools
    with pytest.raises(ValueError, match="needs 8 KV-cache blocks"):
        runner.check(20, 12)


def test_accepted_drafts_on_sliding_layers_leave_the_keys_plain_steps_leave(gemma):
    """Speculative steps with Gemma 3's sliding layer in its own pool: each step feeds the next token and a draft
    of 4 (here the very tokens plain greedy steps choose, so all are kept), whose positions cross into blocks of
    the sliding pool that the plain step would only take later. Every scored position's logits equal the plain
    steps', and so do the tokens: the draft's keys were written into the row's own blocks, not the null block."""
    prompt = gemma.tokenizer.encode(cycle_prompts(1, seed=47, min_words=12, max_words=14)[0])[:22]
    plain = DecoderRunner(gemma, num_slots=2, max_len=96, cuda_graphs=False, block_size=4)
    seq = TextSequence(prompt, SamplingParams(max_tokens=64, temperature=0.0))
    assert plain.admit(seq) and plain.windows is not None
    reference = [plain.prefill([seq])[0]]
    for _ in range(25):
        (t,), _ = plain.choose([seq], reference[-1][None])
        seq.next_token = t
        seq.generated.append(t)
        assert plain.grow(seq)
        reference.append(plain.decode([seq])[0])
    tokens = seq.generated

    runner = DecoderRunner(gemma, num_slots=2, max_len=96, cuda_graphs=False, block_size=4,
                           speculation=Speculation(num_tokens=4, max_rows=2))
    spec = TextSequence(prompt, SamplingParams(max_tokens=64, temperature=0.0))
    assert runner.admit(spec) and runner.windows is not None
    torch.testing.assert_close(runner.prefill([spec])[0], reference[0], atol=1e-4, rtol=1e-4)
    spec.next_token = tokens[0]
    spec.generated.append(tokens[0])
    while len(spec.generated) + 4 < len(tokens):
        n = len(spec.generated)
        draft = tokens[n:n + 4]
        assert runner.grow(spec, len(draft))
        logits = runner.decode_ahead([spec], [draft])
        for j in range(5):
            torch.testing.assert_close(logits[0, j], reference[n + j], atol=1e-4, rtol=1e-4)
        (kept,), _, _ = runner.choose_ahead([spec], [draft], logits)
        assert kept == tokens[n:n + 5]
        spec.generated += kept
        spec.next_token = kept[-1]
    plain.release(seq)
    runner.release(spec)
    assert runner.windows.pool.num_in_use == 0 == runner.blocks.num_in_use
