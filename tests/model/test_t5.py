"""T5 / MADLAD-400 (`T5ForConditionalGeneration`) against `transformers` on the same weights (float32): the
config mapping (RMS norms without mean, relative position buckets, unscaled scores folded into the queries,
gated GELU, an untied output layer or the tied and scaled one), logits with padded sources, the target tag in
front of the source, greedy and 4 beams both ways, and the relative position bias on every CPU backend."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.beam_parity import BeamParity
from tests.helpers.factories import hf_t5_dir
from tests.helpers.fixture_training import LEXICON, assert_varied, lexicon_sentences
from tserve.model.attention import BACKENDS
from tserve.model.checkpoint import load
from tserve.model.decoding import translate
from tserve.model.layers import set_attention_backend
from tserve.model.relative_positions import relative_buckets

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    return hf_t5_dir(tmp_path_factory.mktemp("hf-t5"))


def _padded_logits(ours, hf, texts, target_len=25):
    cfg = ours.config
    sources = [ours.tokenizer.encode(t) for t in texts]
    S = max(map(len, sources))
    src = torch.tensor([s + [cfg.pad_token_id] * (S - len(s)) for s in sources])
    lengths = torch.tensor([len(s) for s in sources])
    mask = (torch.arange(S)[None] < lengths[:, None]).long()
    tgt = torch.randint(3, cfg.vocab_size, (len(texts), target_len), generator=torch.Generator().manual_seed(1))
    tgt[:, 0] = cfg.decoder_start_token_id
    with torch.no_grad():
        return ours.model(src, lengths, tgt), hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits


def _until_eos(ids: list[int], eos: int = 1) -> list[int]:
    """A generated sequence without the start token, up to its first eos (`generate` pads finished rows)."""
    ids = ids[1:]
    return ids[: ids.index(eos) + 1] if eos in ids else ids


TEXTS = ("<2de> the quick brown fox jumps over the lazy dog today where is the station", "<2en> Guten Morgen")


def test_config_and_logits_with_padded_sources(t5):
    ours = load(t5)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(t5).eval()
    cfg = ours.config
    assert ours.task == "translation" and ours.source_format == "hf-t5"
    assert (cfg.norm, cfg.positions, cfg.activation, cfg.tie_embeddings, cfg.output_scale, cfg.bias) == \
        ("rmsnorm", "relative", "gated_gelu_tanh", False, 1.0, False)
    got, ref = _padded_logits(ours, hf, TEXTS)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_original_t5_layout_tied_and_scaled(tmp_path):
    """T5 v1.0 / t5-small: ReLU MLP, the output layer is the embedding and the decoder's output is scaled by
    d_model^-0.5 before it (random weights)."""
    from tests.helpers.multilingual import build_t5

    d = build_t5(tmp_path / "t5-v1", train=False, tied=True, feed_forward_proj="relu")
    ours = load(d)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(d).eval()
    assert ours.config.tie_embeddings and ours.config.output_scale == pytest.approx(64 ** -0.5)
    assert ours.model.lm_head.weight is ours.model.tok_emb.weight
    got, ref = _padded_logits(ours, hf, TEXTS)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_gated_silu_layout_and_the_configs_context(tmp_path):
    """`feed_forward_proj: gated-silu` (SiLU(wi_0 x) * wi_1 x, as some T5 v1.1 fine-tunes are) equals transformers;
    `n_positions`, where a config gives it, sizes the caches (T5 has no position table to say)."""
    from tests.helpers.multilingual import build_t5

    d = build_t5(tmp_path / "t5-silu", train=False, feed_forward_proj="gated-silu")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(raw | {"n_positions": 96}))
    ours = load(d)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(d).eval()
    assert ours.config.activation == "swiglu" and ours.config.max_source_len == ours.config.max_target_len == 96
    got, ref = _padded_logits(ours, hf, TEXTS)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("bidirectional", "buckets", "distance"), [(True, 32, 128), (False, 32, 128), (True, 8, 16),
                                                                    (False, 8, 16)])
def test_relative_buckets_equal_transformers(bidirectional, buckets, distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-300, 301)[None, :] - torch.arange(0, 5)[:, None]
    theirs = T5Attention._relative_position_bucket(relative, bidirectional, buckets, distance)
    assert torch.equal(relative_buckets(relative, bidirectional, buckets, distance), theirs)
    assert int(theirs.max()) == buckets - 1 and len(theirs.unique()) >= buckets - 1  # the logarithmic ones too


def test_the_target_tag_goes_in_front_of_the_source(t5):
    ours = load(t5).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(t5)
    assert ours.target_tagged and list(ours.language_codes) == ["<2en>", "<2de>", "<2fr>"]
    for text in ("the quick brown fox", "Guten Morgen, wo ist der Bahnhof?", "Töchter ☃"):
        ids = theirs(f"<2de> {text}").input_ids
        assert ours.encode_with_language(text, "<2de>") == ids and ids[0] == theirs.convert_tokens_to_ids("<2de>")
        assert ours.decode(ids[1:]) == theirs.decode(ids[1:], skip_special_tokens=True)
        # A translator's source and target for (source, target): the target's tag in front, nothing forced.
        assert ours.source_in(text, ("<2en>", "<2de>")) == ids and ours.target_prefix(("<2en>", "<2de>")) == []


@pytest.mark.parametrize(("tag", "texts"), [
    ("<2de>", lexicon_sentences(5, seed=43, min_words=2, max_words=7)),
    ("<2en>", ["der schnelle braune Fuchs", "Guten Morgen wo ist der Bahnhof", "drei Töchter",
               "der König ist heute schön", "Hallo Welt"]),
])
@pytest.mark.slow
def test_either_direction_greedy_and_four_beams_equal_generate(t5, tag, texts):
    ours = load(t5)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(t5).eval()
    tok = ours.tokenizer
    sources = [tok.encode_with_language(t, tag) for t in texts]
    greedy = [s.output_ids for s in translate(ours, sources, num_beams=1, max_new_tokens=20)]  # batched
    assert_varied(greedy, min_distinct=0.8)
    parity = BeamParity()
    for src, ids in zip(sources, greedy, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([src]), num_beams=1, do_sample=False, max_new_tokens=20)[0].tolist()
        assert ids == _until_eos(ref)
        (seq,) = translate(ours, [src], num_beams=4, max_new_tokens=20)
        (beam_ids, score), = seq.search.hypotheses(1)
        with torch.no_grad():
            out = hf.generate(torch.tensor([src]), num_beams=4, num_return_sequences=4, do_sample=False,
                              max_new_tokens=20, output_scores=True, return_dict_in_generate=True)
        reference = [(_until_eos(s.tolist()), float(v))
                     for s, v in zip(out.sequences, out.sequences_scores, strict=True)]
        parity.check(beam_ids, score, reference, repr(src))
    parity.assert_at_most_one_tie()
    vocabulary = set(LEXICON.values()) if tag == "<2de>" else set(LEXICON)
    for ids in greedy:  # the words of the tagged language
        words = tok.decode(ids).split()
        assert words and sum(w in vocabulary for w in words) >= 0.8 * len(words), (tag, words)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flash"])
def test_position_bias_on_every_cpu_backend(t5, backend):
    """The bias travels as a float mask: `sdpa` adds it as `math` does, encoding, teacher-forced and cached."""
    reference = load(t5, backend="math")
    ours = load(t5)
    set_attention_backend(ours.model, backend)
    texts = ["<2de> the quick brown fox jumps over the lazy dog", "<2en> drei Töchter"]
    got, ref = (_padded_logits(m, transformers.T5ForConditionalGeneration.from_pretrained(t5).eval(), texts)[0]
                for m in (ours, reference))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    sources = [ours.tokenizer.encode(t) for t in texts]
    assert [s.output_ids for s in translate(ours, sources, 4, 16)] == \
        [s.output_ids for s in translate(reference, sources, 4, 16)]
