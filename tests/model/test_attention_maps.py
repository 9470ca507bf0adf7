"""Attention maps of the three model kinds: rows are distributions, causal maps are lower-triangular,
selection works and is validated, and the BertViz form has the shapes of transformers' output_attentions."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers.one_request import mt_tokens
from tserve.model import attention_maps as am
from tserve.model.checkpoint import load

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


def test_lm_maps_are_causal_distributions(tiny_lm):
    loaded = load(tiny_lm)
    maps = am.lm_attention(loaded, "Hello world, this is a test.")
    assert [m.layer for m in maps] == list(range(loaded.config.n_layers))
    for m in maps:
        assert m.module == "decoder.self"
        n = len(m.query_tokens)
        assert m.weights.shape == (loaded.config.n_heads, n, n)
        torch.testing.assert_close(m.weights.sum(-1), torch.ones(loaded.config.n_heads, n))
        assert torch.all(m.weights.triu(diagonal=1) == 0)


def test_selection_and_its_errors(tiny_lm):
    loaded = load(tiny_lm)
    maps = am.lm_attention(loaded, "Hello world", layers=[1], heads=[3, 0])
    assert [m.layer for m in maps] == [1] and maps[0].weights.shape[0] == 2
    full = am.lm_attention(loaded, "Hello world")
    torch.testing.assert_close(maps[0].weights, full[1].weights[[0, 3]])
    with pytest.raises(ValueError, match="numbered 0 to 1"):
        am.lm_attention(loaded, "Hello", layers=[2])
    with pytest.raises(ValueError, match="heads"):
        am.lm_attention(loaded, "Hello", heads=[-1])
    with pytest.raises(ValueError, match="at least one"):
        am.lm_attention(loaded, "Hello", layers=[])


@pytest.mark.parametrize("layers, heads", [(None, None), ([1], [0, 2]), ([0, 7], [3])])
def test_weight_count_is_known_before_the_work(tiny_lm, tiny_mt, tiny_vit, layers, heads):
    """What `/v1/attention` bounds before it runs the model equals what the maps then hold, for each kind."""
    lm, mt, vit = load(tiny_lm), load(tiny_mt), load(tiny_vit)

    def held(maps: list[am.AttentionMap]) -> int:
        return sum(m.weights.numel() for m in maps)

    ids = lm.tokenizer.encode("Hello world, good morning")
    layers_lm = None if layers is None else [i for i in layers if i < lm.config.n_layers]
    assert am.weight_count(lm, layers_lm, heads, len(ids)) == held(am.lm_attention_ids(lm, ids, layers_lm, heads))
    src, tgt = mt.tokenizer.encode("Good morning."), mt.tokenizer.encode_target("Guten Morgen, Welt.")
    tgt = [t for t in tgt if t != mt.config.eos_token_id]
    layers_mt = None if layers is None else [i for i in layers if i < max(am.layer_counts(mt).values())]
    assert am.weight_count(mt, layers_mt, heads, len(src), len(tgt)) == held(
        am.translation_attention_ids(mt, src, tgt, layers_mt, heads))
    layers_vit = None if layers is None else [i for i in layers if i < vit.config.n_layers]
    pixels = torch.rand(vit.config.n_channels, vit.config.image_size, vit.config.image_size)
    assert am.weight_count(vit, layers_vit, heads) == held(am.vit_attention(vit, pixels, layers_vit, heads))


def test_translation_maps(tiny_mt):
    loaded = load(tiny_mt)
    maps, target = am.translation_attention(loaded, "Good morning.", target="Guten Morgen.")
    assert target == "Guten Morgen."
    modules = {m.module for m in maps}
    assert modules == {"encoder.self", "decoder.self", "decoder.cross"}
    for m in maps:
        torch.testing.assert_close(m.weights.sum(-1), torch.ones(m.weights.shape[:2]))
        if m.module == "decoder.cross":
            assert m.key_tokens == next(x for x in maps if x.module == "encoder.self").query_tokens
        if m.module == "decoder.self":
            assert torch.all(m.weights.triu(diagonal=1) == 0)
    own_maps, own = am.translation_attention(loaded, "Good morning.")  # no target: the model's own translation
    # The checkpoint's decoding defaults (its beams), as the translation engine uses them.
    ids = [t for t in mt_tokens(loaded, loaded.tokenizer.encode("Good morning."), loaded.generation.num_beams)
           if t != loaded.config.eos_token_id]
    assert own.strip() and own == loaded.tokenizer.decode(ids)
    decoder = next(m for m in own_maps if m.module == "decoder.self")
    assert decoder.query_tokens == loaded.tokenizer.tokens([loaded.config.decoder_start_token_id, *ids])


def test_vit_maps_and_rollout(tiny_vit):
    loaded = load(tiny_vit)
    maps = am.vit_attention(loaded, torch.randn(1, 28, 28))
    tokens = maps[0].query_tokens
    assert tokens[0] == "[CLS]" and tokens[1] == "patch(0,0)" and len(tokens) == 1 + loaded.config.grid_size ** 2
    rollout = am.attention_rollout(maps)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(len(tokens)))


def test_bertviz_shapes_match_transformers(hf_gpt2, hf_marian):
    ours = load(hf_gpt2)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2, attn_implementation="eager").eval()
    text = "Hello world, good morning"
    bv = am.to_bertviz(am.lm_attention(ours, text))
    ids = ours.tokenizer.encode(text)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_attentions=True).attentions
    assert len(bv["attention"]) == len(ref)
    for got, want in zip(bv["attention"], ref, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-4)
    assert len(bv["tokens"]) == len(ids)

    ours = load(hf_marian)
    hf = transformers.MarianMTModel.from_pretrained(hf_marian, attn_implementation="eager").eval()
    maps, _ = am.translation_attention(ours, "Good morning.", target="Guten Morgen.")
    bv = am.to_bertviz(maps)
    src = ours.tokenizer.encode("Good morning.")
    dec = [ours.config.decoder_start_token_id] + [t for t in ours.tokenizer.encode_target("Guten Morgen.")
                                                  if t != ours.config.eos_token_id]
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([dec]), output_attentions=True)
    for key, want in (("encoder_attention", out.encoder_attentions), ("decoder_attention", out.decoder_attentions),
                      ("cross_attention", out.cross_attentions)):
        assert len(bv[key]) == len(want)
        for got, ref in zip(bv[key], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref, atol=1e-5, rtol=1e-4)
    assert len(bv["encoder_tokens"]) == len(src) and len(bv["decoder_tokens"]) == len(dec)
