"""Bucketed decode steps: padding a batch up to its bucket changes nothing for the real rows. The CUDA-graph
replay of the same buckets is checked in test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kv_rows import advance_if_real_rows_equal, eager_multi_token_step, row_keys
from tserve.model.config import DecoderConfig
from tserve.model.cuda_graphs import BucketedDecode, DecodeAhead, default_buckets
from tserve.model.decoder import Decoder

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(3) == [1, 2, 3]
    assert default_buckets(16) == [1, 2, 4, 8, 16]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        BucketedDecode(lambda x: x, [0], [1], "cpu", use_graphs=True)


@pytest.fixture(scope="module", params=[{}, {"n_kv_heads": 2, "positions": "rope", "qk_norm": True}],
                ids=["mha", "gqa"])
def lm(request) -> Decoder:
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_seq_len=48, **request.param)
    return Decoder(cfg).eval()


def _prefilled(model: Decoder, prompts: list[list[int]], slots: list[int], num_slots: int):
    cache = model.new_cache(num_slots, 48)
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    model.prefill(tokens, lengths, cache, torch.tensor(slots))
    return cache


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (3, 4), (5, 8), (7, 8)])
def test_padded_bucket_step_equals_unpadded_step(lm, n, bucket):
    prompts = [[(7 * i + j) % 60 + 1 for j in range(3 + 2 * i)] for i in range(n)]
    slots = list(range(n))[::-1]  # any slot order
    scratch = 8
    eager_cache = _prefilled(lm, prompts, slots, scratch + 1)
    bucket_cache = _prefilled(lm, prompts, slots, scratch + 1)
    batch_sizes = []

    def step(t, p, s):
        batch_sizes.append(len(t))
        return lm.decode_step(t, p, bucket_cache, s)

    runner = BucketedDecode(step, pad_values=(0, 0, scratch), buckets=default_buckets(8), device="cpu")
    assert runner.bucket(n) == bucket
    tokens = [3 + i for i in range(n)]
    positions = [len(p) for p in prompts]
    for _ in range(4):  # a few steps: the padded rows must not disturb later ones either
        ref = lm.decode_step(torch.tensor(tokens), torch.tensor(positions), eager_cache, torch.tensor(slots))
        out = runner(tokens, positions, slots)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        tokens = ref.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    assert batch_sizes == [bucket] * 4  # the step really ran on the padded batch
    real = torch.tensor(slots)
    torch.testing.assert_close(row_keys(bucket_cache, real), row_keys(eager_cache, real))
    assert row_keys(eager_cache, real).abs().sum() > 0  # the rows' positions, not the null block's


def test_batches_above_the_largest_bucket_run_eagerly(lm):
    prompts = [[1, 2, 3]] * 5
    cache = _prefilled(lm, prompts, list(range(5)), 6)
    calls = []

    def step(t, p, s):
        calls.append(len(t))
        return lm.decode_step(t, p, cache, s)

    runner = BucketedDecode(step, pad_values=(0, 0, 5), buckets=[1, 2], device="cpu")
    out = runner([4] * 5, [3] * 5, list(range(5)))
    assert out.shape == (5, 64) and calls == [5]
    runner([4, 4], [4, 4], [0, 1])
    assert calls[-1] == 2


def test_padded_translation_step_equals_unpadded_step():
    from tserve.model.config import Seq2SeqConfig
    from tserve.model.decoding.seq2seq_runner import static_decode
    from tserve.model.seq2seq import Seq2Seq

    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=60, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                        max_source_len=24, max_target_len=16, decoder_start_token_id=1, eos_token_id=2,
                        pad_token_id=0)
    model = Seq2Seq(cfg).eval()
    sources = [[5, 6, 7, 2], list(range(8, 28)) + [2], [9, 2]]
    src = torch.zeros(3, 21, dtype=torch.long)
    for i, s in enumerate(sources):
        src[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in sources])
    scratch = 7
    caches = [model.new_cache(scratch + 1, scratch + 1) for _ in range(2)]
    cross = torch.tensor([3, 0, 5])
    for cache in caches:
        model.start(src, lengths, cache, cross)
    runner = static_decode(model, caches[1], scratch=scratch, max_batch=scratch, use_graphs=False)
    rows = [6, 1, 2, 4]  # the second source runs two beams
    crosses = [3, 0, 0, 5]
    tokens = torch.tensor([1, 1, 1, 1])
    for step in range(5):
        positions = [step] * 4
        ref = model.decode_step(tokens, torch.tensor(positions), caches[0], torch.tensor(rows), torch.tensor(crosses),
                                kv_len=step + 1, src_len=int(lengths.max()))
        out = runner(tokens, positions, rows, crosses)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        tokens = ref.argmax(-1)


def test_reused_input_buffers_never_read_the_cache_through_an_old_view(lm):
    """The bucket's input tensors are the same objects every call: whether slots are consecutive must be
    decided from their values each time (slots 0, 1 first, then 3, 2)."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    eager_cache = _prefilled(lm, prompts, [0, 1, 2, 3], 5)
    bucket_cache = _prefilled(lm, prompts, [0, 1, 2, 3], 5)
    runner = BucketedDecode(lambda t, p, s: lm.decode_step(t, p, bucket_cache, s), pad_values=(0, 0, 4),
                            buckets=[2], device="cpu")
    for slots, positions in (([0, 1], [3, 2]), ([3, 2], [1, 4])):
        ref = lm.decode_step(torch.tensor([5, 6]), torch.tensor(positions), eager_cache, torch.tensor(slots))
        torch.testing.assert_close(runner([5, 6], positions, slots), ref, atol=1e-5, rtol=1e-5)


def test_padded_speculative_step_equals_unpadded_step(lm):
    """Speculative steps at the captured width and batch bucket (`DecodeAhead`, eager here): each real row's
    logits at its real positions equal the unpadded step's, its positions hold the same keys, and no padding
    position writes into a block outside the null block and the row's own."""
    bs, width, scratch = 4, 5, 4
    prompts = [[5, 9, 2, 7, 1, 3, 3, 6], [4, 8], [6, 1, 2, 9, 9, 4, 2, 8, 11, 12, 13]]  # the first ends a block
    rows = [2, 0, 3]
    caches = [lm.new_cache(scratch, 48, num_blocks=40, block_size=bs) for _ in range(2)]
    # Each row's next blocks are another row's (interleaved), so a write past a row's table would land in them.
    free = iter(range(1, 40))
    tables = {r: [] for r in rows}
    computed = [len(p) for p in prompts]

    def grow(upto: list[int]) -> None:
        for r, n in zip(rows, upto, strict=True):
            while len(tables[r]) * bs < n:
                tables[r].append(next(free))
            for cache in caches:
                cache.set_table(r, tables[r])

    grow(computed)
    for cache in caches:
        tokens = torch.zeros(3, max(computed), dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        lm.prefill(tokens, torch.tensor(computed), cache, torch.tensor(rows))
    ahead = DecodeAhead(lm, caches[1], width=width, max_rows=scratch, max_positions=48, use_graphs=False)
    assert ahead.bucketed.bucket(3) == 4  # the batch is padded with the spare row too
    next_tokens = [3, 10, 20]
    for drafts in ([[1, 2], [], [7, 7, 7, 7]], [[5], [2, 2, 2], []], [[], [], [1]]):
        fed = [[t, *d] for t, d in zip(next_tokens, drafts, strict=True)]
        grow([c + len(f) for c, f in zip(computed, fed, strict=True)])  # blocks for the real feed only
        ref = eager_multi_token_step(lm, fed, computed, caches[0], rows)
        assert ahead.fits(computed, [len(f) for f in fed])
        computed, next_tokens = advance_if_real_rows_equal(ahead(fed, computed, rows), ref, fed, computed, 1e-5)
    for r, n in zip(rows, computed, strict=True):
        keys = [row_keys(cache, torch.tensor([r]))[:, :, :n] for cache in caches]
        torch.testing.assert_close(keys[1], keys[0])
        assert keys[0].abs().sum() > 0
    held = sorted(b for t in tables.values() for b in t)
    untouched = caches[1].k.view(caches[1].k.size(0), -1, bs, *caches[1].k.shape[2:])[:, held[-1] + 1:]
    assert untouched.abs().sum() == 0  # blocks no row holds: never written


def test_a_speculative_step_whose_padding_passes_the_models_positions_does_not_fit(lm):
    ahead = DecodeAhead(lm, lm.new_cache(2, 48), width=5, max_rows=2, max_positions=48, use_graphs=False)
    assert ahead.fits([10, 43], [5, 1])
    assert not ahead.fits([10, 44], [5, 1])  # position 48 would be fed: no embedding for it
    assert not ahead.fits([10], [6])  # wider than captured
    assert not ahead.fits([1, 2, 3], [1, 1, 1])  # more rows than the largest bucket
