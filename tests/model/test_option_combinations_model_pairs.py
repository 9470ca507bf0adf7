"""The paged KV cache where two of its features meet in one forward: a cached prefix read back by a single row whose
blocks are consecutive only as far as its whole blocks go (prefix caching's shared blocks, then a block of its own
from elsewhere in the pool), on a grouped-query model and on a model with sliding layers, each backend; a speculative
row padded past the end of its block table beside a row whose drafts fill theirs; and the sliding layers' own pool
sized for rows that hold their window and their drafts while one whole context is computed besides. The reference
is the model's whole forward over each sequence (no cache), or the pool's stated capacity."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_fused_decode import behaving
from tserve.model.layers import set_attention_backend
from tserve.model.window_blocks import WindowBlocks

# The outcome depends on the CPU's kernels (the cpu-decode backend): `make test-avx2` runs this module again there.
pytestmark = pytest.mark.kernels

BS = 4
SEQUENCE = [5, 17, 3, 40, 2, 9, 11, 60, 8, 1, 33, 21, 7, 50, 88, 13]


def whole_forward(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Logits (T, V) of every position, with no cache."""
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0]


# --- a cached prefix read back by one row whose last block lies elsewhere ------------------------------------------
@pytest.mark.parametrize("backend", ["math", "sdpa", "cpu-decode"])
@pytest.mark.parametrize("layout", ["llama", "gemma3"])
def test_a_rows_prefix_read_back_is_the_same_whether_its_last_block_is_adjacent_or_not(layout, backend):
    """One row prefills 8 tokens (two full blocks, as a cached prefix leaves them), then 2 more from position 8,
    then decodes: its third block is either the next one in the pool or one far away (a prefix shared by another
    sequence, then a block of the row's own). Reading 10 positions spans three blocks, only the first two of them
    consecutive in the second case: the cache must read the third through the table, not as a slice. Both tables
    give the whole forward's logits at every step."""
    model = behaving(layout, seed=3)
    set_attention_backend(model, backend)
    want = whole_forward(model, SEQUENCE[:14])
    for table in ([1, 2, 3, 4], [1, 2, 9, 6]):
        cache = model.new_cache(1, 16, num_blocks=12, block_size=BS)
        cache.set_table(0, table)
        slot = torch.tensor([0])
        with torch.inference_mode():
            model.prefill(torch.tensor([SEQUENCE[:8]]), torch.tensor([8]), cache, slot)
            got = [model.prefill(torch.tensor([SEQUENCE[8:10]]), torch.tensor([2]), cache, slot,
                                 start=torch.tensor([8]))]
        for position in range(10, 14):
            got.append(model.decode_step(torch.tensor([SEQUENCE[position]]), torch.tensor([position]), cache, slot,
                                         kv_len=position + 1))
        for step, logits in enumerate(got):
            torch.testing.assert_close(logits[0], want[9 + step], atol=2e-5, rtol=0,
                                       msg=lambda m, t=table, s=step: f"table {t}, step {s}: {m}")


# --- a speculative row padded past its table beside a full one ------------------------------------------------------
@pytest.mark.parametrize("layout", ["llama", "gemma3"])
def test_padding_past_a_rows_table_leaves_its_own_positions_as_they_were(layout):
    """A speculative step of two rows: one at the last three positions of its 16 (its next token and two drafts,
    padded to the batch's width of four: the padding's position is past its table), one with three drafts early in
    its row. The padding's keys go to the null block; if they landed in the row's own last block they would
    overwrite a position it attends to in the same forward. Each row's real positions give the whole forward's
    logits."""
    model = behaving(layout, seed=5)
    set_attention_backend(model, "sdpa")
    first, second = SEQUENCE, [70, 4, 19, 26, 31, 12, 9, 2]
    cache = model.new_cache(2, 16, num_blocks=9, block_size=BS)
    assert cache.max_len == 16
    cache.set_tables([0, 1], [[5, 2, 7, 1], [3, 8, 4, 6]])
    slots = torch.tensor([0, 1])
    prompts = torch.zeros(2, 13, dtype=torch.long)
    prompts[0], prompts[1, :4] = torch.tensor(first[:13]), torch.tensor(second[:4])
    with torch.inference_mode():
        model.prefill(prompts, torch.tensor([13, 4]), cache, slots)
        tokens = torch.tensor([[*first[13:16], 0], second[4:8]])
        positions = torch.tensor([[13, 14, 15, 16], [4, 5, 6, 7]])
        got = model.decode_tokens(tokens, positions, cache, slots, kv_len=16)
    torch.testing.assert_close(got[0, :3], whole_forward(model, first)[13:16], atol=2e-5, rtol=0)
    torch.testing.assert_close(got[1], whole_forward(model, second)[4:8], atol=2e-5, rtol=0)


# --- the sliding layers' pool under speculative decoding -----------------------------------------------------------
@pytest.mark.parametrize("ahead", [0, 4, 7])
def test_the_sliding_layers_pool_holds_every_rows_window_and_drafts_and_one_context_besides(ahead):
    """`pool_blocks` sizes the sliding layers' own pool for `rows` rows that each hold their window and `ahead`
    draft positions past their next one (a window that starts inside a block), and one whole context being computed
    besides. Filled exactly so, every row grows for its drafts and the long sequence is still admitted."""
    rows, context, window = 3, 96, 16
    blocks = WindowBlocks.pool_blocks(rows, context, window, BS, ahead)
    assert blocks > 0
    pool = WindowBlocks(blocks, BS, window, prefix_caching=False, salt="")
    length = 41  # the next query at 41 reads from 26 on: its window starts in the middle of block 6
    for row in range(rows):
        ids = list(range(row * 100, row * 100 + length))
        table = pool.admit(ids, [], 0)
        pool.computed(table, length, lambda ids=ids: ids)
        assert pool.grow(table, length + 1 + ahead), f"row {row} cannot hold its window and {ahead} drafts"
    assert pool.can_admit(context, 0)
    pool.admit(list(range(context)), [], 0)
