"""NLLB-200 / M2M100 (`M2M100ForConditionalGeneration`) against `transformers` on the same weights (float32):
the config mapping (pre-norm, final norms, fairseq's sinusoidal positions from padding index + 1, scaled
embeddings), logits with padded sources, the NLLB tokenizer's source side, greedy and beam search."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.beam_parity import BeamParity, hf_beam_hypotheses
from tests.helpers.factories import hf_nllb_dir
from tests.helpers.fixture_training import LEXICON, assert_varied, lexicon_sentences
from tserve.model.checkpoint import load
from tserve.model.decoding import translate

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    return hf_nllb_dir(tmp_path_factory.mktemp("hf-nllb"))


def test_config_and_logits_with_padded_sources(nllb):
    ours = load(nllb)
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(nllb).eval()
    cfg = ours.config
    assert ours.task == "translation" and ours.source_format == "hf-m2m_100"
    assert (cfg.norm_placement, cfg.final_norm, cfg.sinusoid, cfg.position_offset) == ("pre", True, "fairseq", 2)
    sources = [ours.tokenizer.encode(t) for t in ("the quick brown fox jumps over the lazy dog", "good morning")]
    S = max(map(len, sources))
    src = torch.tensor([s + [cfg.pad_token_id] * (S - len(s)) for s in sources])
    lengths = torch.tensor([len(s) for s in sources])
    mask = (torch.arange(S)[None] < lengths[:, None]).long()
    tgt = torch.randint(3, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    tgt[:, 0] = cfg.decoder_start_token_id
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        torch.testing.assert_close(ours.model(src, lengths, tgt), ref, atol=1e-4, rtol=1e-4)


def test_the_source_side_is_nllbs(nllb):
    """Language code first, eos last, as transformers' NllbTokenizer writes a source by default."""
    ours = load(nllb).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(nllb, src_lang="eng_Latn")
    for text in ("the quick brown fox", "Guten Morgen, wo ist der Bahnhof?", "Töchter ☃"):
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids and ids[0] == theirs.convert_tokens_to_ids("eng_Latn")
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


SOURCES = lexicon_sentences(6, seed=41, min_words=2, max_words=9)


@pytest.mark.slow  # 3-9 s of transformers' generate; the forced-language tests below compare with it in make test
def test_greedy_and_four_beams_equal_generate(nllb):
    ours = load(nllb)
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(nllb).eval()
    pad = ours.config.pad_token_id
    sources = [ours.tokenizer.encode(t) for t in SOURCES]
    greedy = [s.output_ids for s in translate(ours, sources, num_beams=1, max_new_tokens=20)]  # batched
    assert_varied(greedy, min_distinct=0.8)
    parity = BeamParity()
    for src, ids in zip(sources, greedy, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([src]), num_beams=1, do_sample=False, max_new_tokens=20)[0, 1:].tolist()
        assert ids == [t for t in ref if t != pad]
        (seq,) = translate(ours, [src], num_beams=4, max_new_tokens=20)
        (beam_ids, score), = seq.search.hypotheses(1)
        parity.check(beam_ids, score, hf_beam_hypotheses(hf, src, 4, 20, pad), repr(src))
    parity.assert_at_most_one_tie()


@pytest.mark.parametrize(("source", "target", "texts"), [
    ("eng_Latn", "deu_Latn", lexicon_sentences(5, seed=43, min_words=2, max_words=7)),
    ("deu_Latn", "eng_Latn", ["der schnelle braune Fuchs", "Guten Morgen wo ist der Bahnhof", "drei Töchter",
                              "der König ist heute schön", "Hallo Welt"]),
])
def test_either_direction_with_the_target_language_forced(nllb, source, target, texts):
    """One model, both ways: the source encoded with its language's code, the target's code forced as the
    first token (`forced_bos_token_id`), greedy and 4 beams as `generate` gives them."""
    ours = load(nllb)
    theirs = transformers.AutoTokenizer.from_pretrained(nllb, src_lang=source)
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(nllb).eval()
    tok, pad = ours.tokenizer, ours.config.pad_token_id
    assert set(tok.language_codes) == {"eng_Latn", "deu_Latn", "fra_Latn"}
    forced = tok.language_codes[target]
    sources = [tok.encode_with_language(t, source) for t in texts]
    assert sources == [theirs(t).input_ids for t in texts]
    greedy = [s.output_ids for s in translate(ours, sources, num_beams=1, max_new_tokens=20, forced_first_token=forced)]
    assert_varied(greedy, min_distinct=0.8)
    parity = BeamParity()
    for src, ids in zip(sources, greedy, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([src]), num_beams=1, do_sample=False, max_new_tokens=20,
                              forced_bos_token_id=forced)[0, 1:].tolist()
        assert ids[0] == forced and ids == [t for t in ref if t != pad]
        (seq,) = translate(ours, [src], num_beams=4, max_new_tokens=20, forced_first_token=forced)
        (beam_ids, score), = seq.search.hypotheses(1)
        with torch.no_grad():
            out = hf.generate(torch.tensor([src]), num_beams=4, num_return_sequences=4, do_sample=False,
                              max_new_tokens=20, output_scores=True, return_dict_in_generate=True,
                              forced_bos_token_id=forced)
        reference = [([t for t in s[1:].tolist() if t != pad], float(v))
                     for s, v in zip(out.sequences, out.sequences_scores, strict=True)]
        parity.check(beam_ids, score, reference, repr(src))
    parity.assert_at_most_one_tie()
    vocabulary = {"deu_Latn": set(LEXICON.values()), "eng_Latn": set(LEXICON)}.get(target)
    for ids in greedy if vocabulary else []:  # the words of the forced language
        words = tok.decode(ids).split()
        assert words and sum(w in vocabulary for w in words) >= 0.8 * len(words), (target, words)


def test_the_forced_code_comes_first_where_the_model_would_choose_another(nllb):
    """Unforced, the model starts an English source's translation with German's code (all it learnt);
    forced, with French's, as `generate` with `forced_bos_token_id` does."""
    ours = load(nllb)
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(nllb).eval()
    tok = ours.tokenizer
    sources = [tok.encode_with_language(t, "eng_Latn") for t in ("the quick brown fox", "good morning")]
    assert [s.output_ids[0] for s in translate(ours, sources, 1, 10)] == [tok.language_codes["deu_Latn"]] * 2
    french = tok.language_codes["fra_Latn"]
    for num_beams in (1, 4):
        for src, seq in zip(sources, translate(ours, sources, num_beams, 10, forced_first_token=french), strict=True):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([src]), num_beams=num_beams, do_sample=False, max_new_tokens=10,
                                  forced_bos_token_id=french)[0, 1:].tolist()
            assert seq.output_ids[0] == french and seq.output_ids == [t for t in ref if t != ours.config.pad_token_id]


def test_legacy_behaviour_puts_the_code_last(nllb, tmp_path):
    """NLLB tokenizers saved with `legacy_behaviour` write a source as pieces, eos, code (as transformers does)."""
    import json
    import shutil

    d = tmp_path / "legacy"
    shutil.copytree(nllb, d)
    config = json.loads((d / "tokenizer_config.json").read_text()) | {"legacy_behaviour": True}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load(d).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(d, src_lang="deu_Latn")
    for text in ("der schnelle braune Fuchs", "Guten Morgen"):
        ids = theirs(text).input_ids
        assert ids[-1] == theirs.convert_tokens_to_ids("deu_Latn")
        assert ours.encode_with_language(text, "deu_Latn") == ids


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    from tests.helpers.multilingual import build_m2m100

    return build_m2m100(tmp_path_factory.mktemp("m2m100") / "m2m100")


def test_m2m100_layout_tokenizer_and_logits(m2m100):
    """facebook/m2m100's files (sentencepiece.bpe.model + vocab.json, no tokenizer.json): the language tokens
    follow vocab.json; a source is its language's token, the pieces, eos; random weights give transformers'
    logits."""
    ours = load(m2m100)
    theirs = transformers.AutoTokenizer.from_pretrained(m2m100)
    tok = ours.tokenizer
    assert list(tok.language_codes) == [f"__{c}__" for c in ("en", "ha", "is", "ja", "cs", "ru", "zh", "de")]
    languages = set(tok.language_codes.values())
    for source in ("en", "de"):
        theirs.src_lang = source
        for text in ("The quick brown fox.", "Der schnelle braune Fuchs über den faulen Hund."):
            ids = theirs(text).input_ids
            assert tok.encode_with_language(text, f"__{source}__") == ids
            if source == "en":  # the tokenizer's own source language (src_lang, else English) without one named
                assert tok.encode(text) == ids and tok.encode(text, add_special_tokens=False) == ids[1:-1]
            assert tok.decode(ids) == theirs.decode([i for i in ids if i not in languages], skip_special_tokens=True)
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(m2m100).eval()
    theirs.src_lang = "de"
    src = theirs("Der schnelle braune Fuchs.", return_tensors="pt").input_ids
    tgt = torch.tensor([[2, tok.language_codes["__en__"], 20, 30, 40]])
    with torch.no_grad():
        torch.testing.assert_close(ours.model(src, torch.tensor([src.size(1)]), tgt),
                                   hf(input_ids=src, decoder_input_ids=tgt).logits, atol=1e-4, rtol=1e-4)
    forced = tok.language_codes["__en__"]
    for num_beams in (1, 4):
        (seq,) = translate(ours, [src[0].tolist()], num_beams, 12, forced_first_token=forced)
        with torch.no_grad():
            ref = hf.generate(src, num_beams=num_beams, do_sample=False, max_new_tokens=12,
                              forced_bos_token_id=forced)[0, 1:].tolist()
        assert seq.output_ids == [t for t in ref if t != ours.config.pad_token_id] and seq.output_ids[0] == forced
