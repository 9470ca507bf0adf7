"""The three architectures: cached == uncached, padded batch == each alone, causality, configs, MoE."""

import json

import pytest
import torch

from tserve.model.config import BlockConfig, DecoderConfig, Seq2SeqConfig, ViTConfig, load_config
from tserve.model.decoder import Decoder
from tserve.model.kv_cache import PagedCrossKV, PagedKVCache, SharedSources, SlotAllocator
from tserve.model.layers import set_attention_backend
from tserve.model.seq2seq import Seq2Seq
from tserve.model.vit import ViT

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

SMALL = dict(d_model=32, n_heads=4, d_ff=64)

DECODER_VARIANTS = [
    dict(),
    dict(positions="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False),
    dict(positions="sinusoidal", norm_placement="post", activation="relu", scale_embeddings=True),
    dict(n_experts=4, moe_top_k=2),
]


def _decoder(**kw):
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=61, n_layers=2, max_seq_len=48, **SMALL, **kw)).eval()


@pytest.mark.parametrize("variant", DECODER_VARIANTS, ids=["gpt", "rope-rms-swiglu", "sin-post-relu", "moe"])
def test_decoder_cached_equals_full_recompute(variant):
    model = _decoder(**variant)
    tokens = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
    cache = model.new_cache(num_slots=5, max_len=16)
    slots = torch.tensor([4, 0, 2])
    logits = model.prefill(tokens[:, :4], torch.tensor([4, 4, 4]), cache, slots)
    torch.testing.assert_close(logits, full[:, 3], atol=1e-5, rtol=1e-5)
    for t in range(4, 12):
        logits = model.decode_step(tokens[:, t], torch.full((3,), t), cache, slots)
        torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=1e-5)


def test_decoder_padded_batch_equals_each_alone_and_independent_positions():
    model = _decoder()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 61, (n,), generator=g) for n in (7, 3, 5)]
    padded = torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lengths = torch.tensor([len(p) for p in prompts])
    cache = model.new_cache(3, 20)
    slots = torch.arange(3)
    batched = model.prefill(padded, lengths, cache, slots)
    nxt = batched.argmax(-1)
    step = model.decode_step(nxt, lengths, cache, slots, kv_len=8)
    for i, p in enumerate(prompts):
        alone_cache = model.new_cache(1, 20)
        one = torch.zeros(1, dtype=torch.long)
        alone = model.prefill(p[None], torch.tensor([len(p)]), alone_cache, one)
        torch.testing.assert_close(batched[i], alone[0], atol=1e-5, rtol=1e-5)
        alone_step = model.decode_step(nxt[i : i + 1], torch.tensor([len(p)]), alone_cache, one)
        torch.testing.assert_close(step[i], alone_step[0], atol=1e-5, rtol=1e-5)


def test_changing_a_future_token_never_changes_earlier_outputs():
    model = _decoder(positions="rope")
    tokens = torch.randint(0, 61, (1, 10), generator=torch.Generator().manual_seed(3))
    changed = tokens.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 61
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_decoder_attention_maps_are_causal_distributions():
    model = _decoder()
    tokens = torch.randint(0, 61, (2, 9))
    logits, maps = model.forward_with_attention(tokens)
    assert sorted(maps) == [0, 1]
    with torch.no_grad():
        torch.testing.assert_close(logits, model(tokens), atol=1e-5, rtol=1e-5)
    for probs in maps.values():
        assert probs.shape == (2, 4, 9, 9)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 9), atol=1e-5, rtol=0)
        assert torch.all(probs.triu(1) == 0)


def test_backends_agree_for_whole_models():
    model = _decoder()
    tokens = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        sdpa = model(tokens)
        set_attention_backend(model, "math")
        math = model(tokens)
    torch.testing.assert_close(sdpa, math, atol=1e-5, rtol=1e-5)


def _seq2seq(backend: str = "auto", **kw):
    torch.manual_seed(0)
    return Seq2Seq(Seq2SeqConfig(vocab_size=53, n_encoder_layers=2, n_decoder_layers=2, max_source_len=24,
                                 max_target_len=24, **SMALL, **kw), backend=backend).eval()


@pytest.mark.parametrize("variant", [dict(), dict(norm_placement="pre", final_norm=True, positions="learned"),
                                     dict(positions="rope", final_logits_bias=True)])
def test_seq2seq_cached_equals_teacher_forcing_with_padding(variant):
    model = _seq2seq(**variant)
    g = torch.Generator().manual_seed(4)
    src = torch.randint(3, 53, (2, 9), generator=g)
    src_len = torch.tensor([9, 5])
    tgt = torch.randint(3, 53, (2, 6), generator=g)
    with torch.no_grad():
        full = model(src, src_len, tgt)
    cache = model.new_cache(4, 3, max_target_len=8, max_source_len=12)
    slots, cross = torch.tensor([3, 1]), torch.tensor([2, 0])
    model.start(src, src_len, cache, cross)
    for t in range(6):
        logits = model.decode_step(tgt[:, t], torch.full((2,), t), cache, slots, cross)
        torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=1e-5)
    # The short source alone gives the same logits as inside the padded batch.
    with torch.no_grad():
        alone = model(src[1:, :5], src_len[1:], tgt[1:])
    torch.testing.assert_close(alone[0], full[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "cpu-decode"])
def test_rows_sharing_a_source_attend_to_it_as_one_query_block(backend):
    """Beams read their source's cross-attention keys once (`SharedSources`; on `cpu-decode` each row reads its
    source in place): rows of unequal groups, interleaved, each with its own target, get exactly their own
    teacher-forced logits."""
    model = _seq2seq(backend)
    with torch.no_grad():  # sharp cross-attention: each row's output depends on its own query
        for block in model.decoder:
            block.cross_attn.q.weight.mul_(30)
    g = torch.Generator().manual_seed(5)
    src = torch.randint(3, 53, (3, 9), generator=g)
    src_len = torch.tensor([9, 4, 7])
    source_of_row = torch.tensor([1, 0, 2, 1, 1, 0])  # source 1 has three rows, 0 two, 2 one
    tgt = torch.randint(3, 53, (6, 5), generator=g)
    with torch.no_grad():
        full = model(src[source_of_row], src_len[source_of_row], tgt)
    cache = model.new_cache(8, 4, max_target_len=8, max_source_len=12)
    cross = torch.tensor([3, 0, 1])
    model.start(src, src_len, cache, cross)
    shared = SharedSources.of(cross[source_of_row])
    assert shared is not None and shared.slots.tolist() == [0, 3, 1] and shared.query_rows.shape == (3, 3)
    slots = torch.tensor([7, 2, 5, 0, 4, 1])
    for t in range(5):
        logits = model.decode_step(tgt[:, t], torch.full((6,), t), cache, slots, cross[source_of_row])
        torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=1e-5)
    assert SharedSources.of(torch.tensor([2, 0, 1])) is None  # nothing shared: each row reads its own


def test_learned_positions_of_each_side_are_its_own():
    """`positions="learned"`: the encoder adds its own table, the decoder its own (neither reads the other's)."""
    model = _seq2seq(positions="learned")
    src, tgt, lengths = torch.randint(3, 53, (1, 7)), torch.randint(3, 53, (1, 4)), torch.tensor([7])
    with torch.no_grad():
        memory, logits = model.encode(src, lengths)[0], model(src, lengths, tgt)
        model.dec_pos_emb.weight.normal_()
        assert torch.equal(model.encode(src, lengths)[0], memory)
        assert not torch.allclose(model(src, lengths, tgt), logits, atol=1e-3)
        model.enc_pos_emb.weight.normal_()
        assert not torch.allclose(model.encode(src, lengths)[0], memory, atol=1e-3)


def test_seq2seq_attention_maps():
    model = _seq2seq()
    src, tgt = torch.randint(3, 53, (1, 7)), torch.randint(3, 53, (1, 4))
    _, maps = model.forward_with_attention(src, torch.tensor([7]), tgt, layers={1})
    assert list(maps.encoder) == [1] and maps.encoder[1].shape == (1, 4, 7, 7)
    assert maps.decoder[1].shape == (1, 4, 4, 4) and torch.all(maps.decoder[1].triu(1) == 0)
    assert maps.cross[1].shape == (1, 4, 4, 7)
    for m in (maps.encoder[1], maps.decoder[1], maps.cross[1]):
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]), atol=1e-5, rtol=0)
    logits, every = model.forward_with_attention(src, torch.tensor([7]), tgt)  # no selection: every layer's
    layers = set(range(model.cfg.n_encoder_layers))
    assert set(every.encoder) == set(every.decoder) == set(every.cross) == layers and len(layers) > 1
    assert torch.equal(every.cross[1], maps.cross[1])
    torch.testing.assert_close(logits, model(src, torch.tensor([7]), tgt), atol=1e-5, rtol=0)


def test_vit_unmasked_attention_and_padding_free_batching():
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=16, patch_size=4, n_channels=3, n_layers=2, n_classes=5, **SMALL)).eval()
    pixels = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        batched = model(pixels)
        for i in range(3):
            torch.testing.assert_close(model(pixels[i : i + 1])[0], batched[i], atol=1e-5, rtol=1e-5)
    _, maps = model.forward_with_attention(pixels[:1])
    assert maps[0].shape == (1, 4, 17, 17)
    assert model.token_names()[:3] == ["[CLS]", "patch(0,0)", "patch(0,1)"]


@pytest.mark.parametrize("cfg", [DecoderConfig(positions="rope", n_experts=4), Seq2SeqConfig(), ViTConfig()])
def test_config_json_round_trip(cfg, tmp_path):
    again = BlockConfig.from_json(cfg.to_json())
    assert again == cfg and type(again) is type(cfg)
    cfg.save(tmp_path / "config.json")
    assert load_config(tmp_path / "config.json") == cfg
    assert json.loads(cfg.to_json())["architecture"] == cfg.architecture


@pytest.mark.parametrize("bad", [dict(d_model=30, n_heads=4), dict(norm="batchnorm"), dict(activation="tanh"),
                                 dict(n_experts=2, moe_top_k=3), dict(positions="alibi")])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        DecoderConfig(**bad)
    with pytest.raises(ValueError, match="unknown decoder config fields"):
        DecoderConfig.from_dict({"architecture": "decoder", "n_layerz": 2})


def test_the_sliding_layers_rotate_with_their_own_base_and_scaling():
    """Every layer sliding, with a window over every position: the model the same as one whose layers all
    attend globally with the sliding layers' rope base and scaling as its own."""
    rope = dict(positions="rope", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2)
    scaling = {"rope_type": "linear", "factor": 3.0}
    local = _decoder(**rope, sliding_window=48, sliding_layers=[0, 1], local_rope_base=50.0,
                     local_rope_scaling=scaling)
    as_global = _decoder(**rope, rope_base=50.0, rope_scaling=scaling)
    plain = _decoder(**rope, rope_base=50.0)
    as_global.load_state_dict(local.state_dict())
    plain.load_state_dict(local.state_dict())
    tokens = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(local(tokens), as_global(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(local(tokens), plain(tokens), atol=1e-3)  # the scaling changes the outputs


def test_a_bias_setting_of_the_mlp_overrides_the_models():
    """`mlp_bias` (Llama's config key) decides the MLP's biases alone; `bias` the attention's."""
    for bias, mlp_bias in ((False, True), (True, False)):
        model = _decoder(positions="rope", norm="rmsnorm", activation="swiglu", bias=bias, mlp_bias=mlp_bias)
        names = [n for n, _ in model.named_parameters() if n.endswith(".bias") and ".blocks.0." in f".{n}"]
        assert any(".mlp." in n for n in names) == mlp_bias, names
        assert any(".attn." in n for n in names) == bias, names


def test_the_rotary_part_may_be_the_whole_head():
    assert DecoderConfig(d_model=32, n_heads=2, positions="rope", rotary_dim=16).rotary_dim == 16
    with pytest.raises(ValueError, match="rotary_dim"):
        DecoderConfig(d_model=32, n_heads=2, positions="rope", rotary_dim=18)


def test_moe_routes_to_top_k_experts():
    torch.manual_seed(0)
    model = _decoder(n_experts=4, moe_top_k=1)
    moe = model.blocks[0].mlp
    x = torch.randn(5, 32)
    chosen = moe.router(x).argmax(-1)
    expected = torch.stack([moe.experts[int(e)](x[i]) for i, e in enumerate(chosen)])
    torch.testing.assert_close(moe(x), expected, atol=1e-6, rtol=1e-5)


def test_slot_allocator_hands_out_the_lowest_free_slots():
    alloc = SlotAllocator(3)
    assert alloc.allocate(2) == [0, 1] and alloc.num_free == 1
    alloc.free([0])
    assert alloc.allocate(2) == [0, 2]
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    with pytest.raises(RuntimeError):
        alloc.free([5])


def test_cross_keys_and_values_live_in_their_slots_blocks_of_the_pool():
    """A source's cross-attention keys/values are written into the blocks of its slot's table (anywhere in the
    pool the decoder rows draw from) and read back in the order asked, each slot its own; after a new table or
    a new write, the cache is read again, not the copy kept from the last read."""
    pool = PagedKVCache(2, 12, 4, 2, 3, num_rows=1, max_len=8)
    cross = PagedCrossKV(pool, 3, 10)
    cross.set_table(0, [7, 2, 9])
    cross.set_table(2, [4, 11])
    k, v = torch.randn(2, 2, 2, 10, 3), torch.randn(2, 2, 2, 10, 3)  # (layers, sources, H, T, D)
    cross.write(torch.tensor([0, 2]), [(k[i], v[i]) for i in range(2)], torch.tensor([10, 6]))
    assert cross.lengths.tolist() == [10, 0, 6]
    assert torch.equal(pool.k[1, 2 * 4:3 * 4], k[1, 0, :, 4:8].transpose(0, 1))  # positions 4-7: block 2
    read = cross.reader(torch.tensor([2, 0]), 6)
    for layer in range(2):
        assert torch.equal(read(layer)[0], k[layer, [1, 0], :, :6])
        assert torch.equal(read(layer)[1], v[layer, [1, 0], :, :6])
    assert cross.reader(torch.tensor([2, 0]), 6)(1) is read(1)  # the same sources: the copy kept
    cross.write(torch.tensor([2]), [(k[i, :1] + 1, v[i, :1]) for i in range(2)], torch.tensor([6]))
    assert torch.equal(cross.reader(torch.tensor([2, 0]), 6)(0)[0][0], k[0, 0, :, :6] + 1)
    cross.set_table(2, [7, 2])  # now it reads slot 0's first blocks
    assert torch.equal(cross.reader(torch.tensor([2, 0]), 6)(1)[0][0], k[1, 0, :, :6])
    cross.keep_reads = False  # (CUDA's way) each layer gathers its own, nothing kept
    assert torch.equal(cross.reader(torch.tensor([0, 2]), 6)(1)[1], v[1, [0, 0], :, :6])
