"""Our implementation against `transformers` on the same tiny weights (briefly trained, so that outputs depend
on the input; see fixture_training), in float32."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import factories
from tests.helpers.beam_parity import BeamParity, hf_beam_hypotheses
from tests.helpers.fixture_training import (
    assert_varied,
    cycle_prompts,
    lexicon_sentences,
    sentences_where_beams_matter,
)
from tests.helpers.one_request import lm_tokens
from tserve.model.checkpoint import load
from tserve.model.decoding import SamplingParams, translate

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")


def test_gpt2_logits_and_greedy_tokens(hf_gpt2):
    ours = load(hf_gpt2)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2).eval()
    assert ours.task == "text-generation" and ours.source_format == "hf-gpt2"
    tokens = torch.randint(0, ours.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours.model(tokens)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)

    runs = []
    for text in cycle_prompts(4, seed=5):
        prompt = ours.tokenizer.encode(text)
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=40, pad_token_id=ours.config.eos_token_id)
        hf_new = hf_out[0, len(prompt):].tolist()
        params = SamplingParams(max_tokens=40, temperature=0.0)
        our_new = lm_tokens(ours, prompt, params)
        assert len(our_new) >= 30 or our_new[-1] == ours.config.eos_token_id
        assert our_new == hf_new
        runs.append(our_new)
    assert_varied(runs, min_distinct=1.0)


def _marian_inputs(ours, texts):
    return [ours.tokenizer.encode(t) for t in texts]


def test_marian_logits_with_padding(hf_marian):
    ours = load(hf_marian)
    hf = transformers.MarianMTModel.from_pretrained(hf_marian).eval()
    assert ours.task == "translation" and ours.generation.num_beams == 4
    sources = _marian_inputs(ours, ["Good morning.", "Where is the station? I don't know why."])
    S = max(map(len, sources))
    pad = ours.config.pad_token_id
    src = torch.tensor([s + [pad] * (S - len(s)) for s in sources])
    lengths = torch.tensor([len(s) for s in sources])
    mask = (torch.arange(S)[None] < lengths[:, None]).long()
    tgt = torch.randint(0, ours.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        got = ours.model(src, lengths, tgt)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# Up to 10 words: longer than most training sentences, where the model is less sure.
SENTENCES = lexicon_sentences(6, seed=11, min_words=2, max_words=10)


def test_marian_greedy_translation_identical(hf_marian):
    ours = load(hf_marian)
    hf = transformers.MarianMTModel.from_pretrained(hf_marian).eval()
    sources = _marian_inputs(ours, SENTENCES)
    got = [s.output_ids for s in translate(ours, sources, num_beams=1, max_new_tokens=30)]  # batched
    assert_varied(got, min_distinct=1.0)
    for src, ids in zip(sources, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([src]), num_beams=1, do_sample=False, max_new_tokens=30)[0, 1:].tolist()
        assert ids == [t for t in ref if t != ours.config.pad_token_id]


def test_marian_beam_search_identical(hf_marian):
    """4 beams give `generate`'s first hypothesis and its `sequences_scores` (to a near-tie on at most one
    input: `beam_parity`)."""
    ours = load(hf_marian)
    hf = transformers.MarianMTModel.from_pretrained(hf_marian).eval()

    # Sentences on which 4 beams find another translation than greedy decoding, and as many on which they
    # may agree, drawn with another seed: sentences drawn with one seed share their first words.
    differ = sentences_where_beams_matter(ours, 3)
    texts = differ + [t for t in lexicon_sentences(6, seed=23, min_words=2, max_words=10) if t not in differ][:3]
    lengths_seen, beams, parity = set(), [], BeamParity()
    for text in texts:
        src = ours.tokenizer.encode(text)
        for max_new in (12, 30):
            (seq,) = translate(ours, [src], num_beams=4, max_new_tokens=max_new)
            (ids, score), = seq.search.hypotheses(1)
            assert ids == seq.output_ids
            reference = hf_beam_hypotheses(hf, src, 4, max_new, ours.config.pad_token_id)
            parity.check(ids, score, reference, f"{text!r}, max_new_tokens={max_new}")
            lengths_seen.add(len(ids))
            beams.append(ids)
    parity.assert_at_most_one_tie()
    assert len(lengths_seen) > 1  # some hypotheses ended on eos before the limit
    assert_varied(beams)


@pytest.mark.parametrize("family", ["vit", "deit", "deit-teacher"])
def test_image_classifier_logits_and_top5(family, hf_vit, tmp_path):
    """ViT, and DeiT with its distillation token (with a teacher: its own head, the two averaged)."""
    directory = hf_vit if family == "vit" else factories.hf_vit_dir(tmp_path / family, family=family)
    ours = load(directory)
    hf = transformers.AutoModelForImageClassification.from_pretrained(directory).eval()
    assert ours.labels[:2] == ["cat", "dog"] and ours.preprocessing.image_size == 16
    assert ours.model.token_names()[:2] == (["[CLS]", "patch(0,0)"] if family == "vit" else ["[CLS]", "[DIST]"])
    pixels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(pixel_values=pixels).logits
        got = ours.model(pixels)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    ref_p, ref_i = ref.softmax(-1).topk(5)
    got_p, got_i = got.softmax(-1).topk(5)
    assert torch.equal(ref_i, got_i)
    torch.testing.assert_close(got_p, ref_p, atol=1e-4, rtol=0)
