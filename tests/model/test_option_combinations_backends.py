"""The attention backends where a model feature leaves the configuration its own tests use: sliding-window layers on
the Triton backends (`flash`, `flash-decode`: their decode kernel reads no window, so those layers must decode from
a gathered copy under the window's mask), T5's relative position bias on `flash` (a float mask, which the Triton
kernels do not take), and a translator's decoder rows at different positions in one step on each CPU backend (the
`math` and `sdpa` steps attend through a mask built from each row's own position; `cpu-decode` reads each row's
length). The reference is the `math` backend, or the model's own teacher-forced forward, on the same weights.

The Triton kernels run in Triton's interpreter on a CPU (conftest), on tiny shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tserve.model.config import DecoderConfig, Seq2SeqConfig
from tserve.model.decoder import Decoder
from tserve.model.seq2seq import Seq2Seq


def _twin(make, backend: str):  # noqa: ANN001, ANN202
    """`make("math")` and `make(backend)` with the same weights, in eval mode."""
    torch.manual_seed(0)
    ref = make("math").eval()
    other = make(backend).eval()
    other.load_state_dict(ref.state_dict())
    return ref, other


# --- sliding-window layers on the Triton backends ------------------------------------------------------------------
WINDOWED = DecoderConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2, max_seq_len=48,
                         positions="rope", sliding_window=5, sliding_layers=[0])


@pytest.mark.parametrize("backend", ["flash", "flash-decode"])
def test_sliding_layers_decode_within_their_window_on_the_triton_backends(backend):
    """Mistral / Gemma-style layers: layer 0 sees its last 5 positions, layer 1 everything, 4 query heads on 2 kv
    heads. Rows of 3, 12 and 1 tokens (two of them past the window) are prefilled into a static cache and then
    take three steps together; every prefill and step logit equals the `math` backend's. The Triton decode kernel
    reads a row's whole length: a sliding layer that reached it would attend past its window (or fail on the
    window argument the CPU kernel takes)."""
    pytest.importorskip("triton")
    ref, other = _twin(lambda b: Decoder(WINDOWED, backend=b), backend)
    assert other.blocks[1].attn._cached_decode is not None  # the global layer decodes on the Triton kernel
    prompts = [[1, 2, 3], list(range(5, 17)), [7]]
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(3, 12, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    slots = torch.tensor([2, 0, 1])
    outs = []
    for model in (ref, other):
        cache = model.new_cache(3, 24, block_size=4)
        got = [model.prefill(tokens, lengths, cache, slots)]
        positions = lengths.clone()
        for step in range(3):
            nxt = torch.tensor([9, 8, 7]) + step
            got.append(model.decode_step(nxt, positions, cache, slots, kv_len=int(positions.max()) + 1))
            positions = positions + 1
        outs.append(torch.stack(got))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    # The window matters here: the same weights without it decode otherwise.
    unwindowed = Decoder(dataclasses.replace(WINDOWED, sliding_window=None, sliding_layers=[]), backend="math").eval()
    unwindowed.load_state_dict(ref.state_dict())
    with torch.no_grad():
        long_row = torch.tensor([list(range(5, 17))])
        assert not torch.allclose(unwindowed(long_row), ref(long_row), atol=1e-3)


# --- T5's relative position bias on flash --------------------------------------------------------------------------
def _relative(backend: str) -> Seq2Seq:
    cfg = Seq2SeqConfig(vocab_size=53, n_encoder_layers=2, n_decoder_layers=2, max_source_len=24,
                        max_target_len=24, d_model=32, n_heads=4, d_ff=64, positions="relative",
                        relative_buckets=8, relative_max_distance=16)
    return Seq2Seq(cfg, backend=backend)


def test_t5_position_bias_on_flash_equals_math_with_padded_sources():
    """T5's relative bias reaches the attention as a float mask (the bias, -inf where a key may not be seen): the
    `flash` backend hands such calls to `sdpa`, since its kernels take boolean masks only (T5's cross-attention,
    boolean, stays on them). A batch of a 9- and a 4-token source, teacher-forced over 6 target tokens, gives the
    `math` backend's logits, and a decode step over the cache gives the same."""
    pytest.importorskip("triton")
    ref, fl = _twin(_relative, "flash")
    with torch.no_grad():  # a bias large enough to matter beside the random scores
        for m in (ref, fl):
            for table in (m.enc_rel_bias.table, m.dec_rel_bias.table):
                table.weight.copy_(torch.randn(table.weight.shape, generator=torch.Generator().manual_seed(3)))
    g = torch.Generator().manual_seed(4)
    src = torch.randint(3, 53, (2, 9), generator=g)
    src_len = torch.tensor([9, 4])
    tgt = torch.randint(3, 53, (2, 6), generator=g)
    with torch.no_grad():
        want = ref(src, src_len, tgt)
        torch.testing.assert_close(fl(src, src_len, tgt), want, atol=1e-5, rtol=1e-5)
    cache = fl.new_cache(2, 2, max_target_len=8, max_source_len=12)
    slots = torch.tensor([1, 0])
    fl.start(src, src_len, cache, slots)
    for t in range(3):
        logits = fl.decode_step(tgt[:, t], torch.full((2,), t), cache, slots, slots)
        torch.testing.assert_close(logits, want[:, t], atol=1e-5, rtol=1e-5)


# --- a translator's rows at different positions in one step, each CPU backend ---------------------------------------
@pytest.mark.kernels  # sdpa's and cpu-decode's CPU kernels
@pytest.mark.parametrize("backend", ["math", "sdpa", "cpu-decode"])
def test_translator_rows_at_different_positions_in_one_step_each_attend_over_their_own(backend):
    """Requests that started at different times decode together (Marian's layout: no position bias): one row has
    taken four steps alone when two others join at position 0 and 2. From then on each step feeds rows at different
    positions, and each row's logits equal its own teacher-forced ones: a row attends over its own positions
    [0, position] of its cache row, neither fewer (a later row limited to an earlier one's) nor more (the unwritten
    positions of a row behind)."""
    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=53, n_encoder_layers=2, n_decoder_layers=2, max_source_len=24,
                                  max_target_len=24, d_model=32, n_heads=4, d_ff=64), backend=backend).eval()
    g = torch.Generator().manual_seed(6)
    src = torch.randint(3, 53, (3, 9), generator=g)
    src_len = torch.tensor([9, 5, 7])
    tgt = torch.randint(3, 53, (3, 10), generator=g)
    with torch.no_grad():
        want = model(src, src_len, tgt)
    cache = model.new_cache(3, 3, max_target_len=12, max_source_len=12)
    slots, cross = torch.tensor([2, 0, 1]), torch.tensor([1, 2, 0])
    model.start(src, src_len, cache, cross)
    for t in range(4):  # the first request alone
        logits = model.decode_step(tgt[:1, t], torch.tensor([t]), cache, slots[:1], cross[:1], kv_len=t + 1)
        torch.testing.assert_close(logits[0], want[0, t], atol=1e-5, rtol=1e-5)
    for t in range(2):  # the third request's first two steps, beside nobody
        logits = model.decode_step(tgt[2:, t], torch.tensor([t]), cache, slots[2:], cross[2:], kv_len=t + 1)
    start = torch.tensor([4, 0, 2])
    for step in range(5):
        positions = start + step
        tokens = tgt[torch.arange(3), positions]
        logits = model.decode_step(tokens, positions, cache, slots, cross, kv_len=int(positions.max()) + 1)
        torch.testing.assert_close(logits, want[torch.arange(3), positions], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, s=step: f"{backend}, step {s}: {m}")
