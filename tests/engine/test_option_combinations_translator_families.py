"""Translation features whose tests run on a one-pair translator, checked on the multilingual families where
each family's peculiarity meets them: NLLB's target language code, forced as the decoder's first token (rows of
one batch forced to different codes, glossary terms, max_tokens, word alignments and attention maps of a given
target), and MADLAD-400's `<2xx>` tag in front of the source (an identical text's encoder output reused for
another target). The reference is `transformers`' `generate` (or forward pass) on the same weights; every app
runs in this process on the committed fixtures, so that the tests take seconds."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tserve.model.alignment import token_spans
from tserve.model.checkpoint import load
from tserve.model.decoding.seq2seq_runner import run_jobs, translation_job

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")

CODES = {"en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn"}


class Translators(InProcessApp):
    def one(self, **body) -> dict:
        (item,) = self.post("/v1/translations", body).json()["data"]
        return item


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"nllb": factories.hf_nllb_dir(root / "nllb"), "madlad": factories.hf_t5_dir(root / "madlad")}


@pytest.fixture(scope="module")
def app(checkpoints):
    served = Translators(checkpoints)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def nllb_reference(checkpoints):
    """transformers' NLLB: (tokenizer, model), and generate from `source` into `target` (NLLB codes)."""
    tok = transformers.AutoTokenizer.from_pretrained(checkpoints["nllb"])
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(checkpoints["nllb"],
                                                                     attn_implementation="eager").eval()

    def generate(text: str, source: str, target: str, num_beams: int = 1, max_new_tokens: int = 40) -> list[int]:
        tok.src_lang = source
        with torch.no_grad():
            out = hf.generate(tok(text, return_tensors="pt").input_ids, num_beams=num_beams,
                              max_new_tokens=max_new_tokens, forced_bos_token_id=tok.convert_tokens_to_ids(target))
        return out[0, 1:].tolist()  # without the decoder start token

    return tok, hf, generate


@pytest.fixture(scope="module")
def t5_reference(checkpoints):
    """transformers' MADLAD-400-shaped T5: the translation of `text` into `target` (`de`, `fr`, `en`)."""
    tok = transformers.AutoTokenizer.from_pretrained(checkpoints["madlad"])
    hf = transformers.T5ForConditionalGeneration.from_pretrained(checkpoints["madlad"]).eval()

    def translate(text: str, target: str, num_beams: int = 1) -> str:
        with torch.no_grad():
            out = hf.generate(tok(f"<2{target}> {text}", return_tensors="pt").input_ids, num_beams=num_beams,
                              max_new_tokens=40)
        return tok.decode(out[0], skip_special_tokens=True)

    return translate


def test_greedy_and_beam_rows_of_one_batch_each_start_with_their_own_target_code(checkpoints, nllb_reference):
    """Rows forced to different language codes in one decoder step (English into German and into French, German
    into English; greedy and beams): each row may start with its own code only, so each translation is what
    `generate` gives for its pair alone, French too, which the model would never choose by itself."""
    tok, _, generate = nllb_reference
    loaded = load(checkpoints["nllb"])
    ours = loaded.tokenizer
    asked = [("the quick brown fox", "en", "de", 1), ("the quick brown fox", "en", "fr", 1),
             ("der schnelle braune Fuchs", "de", "en", 1), ("the king is nice today", "en", "fr", 4),
             ("the king is nice today", "en", "de", 4)]
    jobs = [translation_job(loaded, ours.encode_with_language(text, CODES[s]), beams, 40, ours.language_codes[CODES[t]])
            for text, s, t, beams in asked]
    got = [seq.output_ids for seq in run_jobs(loaded, jobs)]
    want = [generate(text, CODES[s], CODES[t], beams) for text, s, t, beams in asked]
    assert got == want
    assert got[0][0] == ours.language_codes["deu_Latn"] and got[1][0] == ours.language_codes["fra_Latn"]
    assert ours.decode(got[0]) != ours.decode(got[1])


def test_a_glossary_on_nllb_places_the_term_after_the_target_code_as_beams_would(app, nllb_reference):
    """A glossary term the model places anyway: the constrained search with its 4 beams finds what 4-beam
    `generate` finds, the target code first (French too, which the model would not choose by itself) and the
    term's own pieces (no language code among them)."""
    tok, _, generate = nllb_reference
    text = "the quick brown fox"
    for target in ("de", "fr"):
        want = tok.decode(generate(text, "eng_Latn", CODES[target], 4), skip_special_tokens=True)
        glossary = {"fox": want.split()[-1]}  # German: fox → Fuchs
        got = app.one(model="nllb", input=text, source_lang="en", target_lang=target, glossary=glossary,
                      cache=False)
        assert got["translation"] == want, (target, glossary)


def test_max_tokens_on_nllb_counts_the_target_code_as_generate_does(app, nllb_reference):
    """max_tokens is what `generate` calls max_new_tokens: the forced language code is the first of them."""
    tok, _, generate = nllb_reference
    text = "good morning where is the station"
    for limit in (2, 4):
        ids = generate(text, "eng_Latn", "deu_Latn", max_new_tokens=limit)
        assert len(ids) == limit and tok.eos_token_id not in ids
        answer = app.post("/v1/translations", {"model": "nllb", "input": text, "source_lang": "en", "target_lang": "de",
                                               "max_tokens": limit, "cache": False}).json()
        assert answer["data"][0]["translation"] == tok.decode(ids, skip_special_tokens=True)
        assert answer["usage"]["completion_tokens"] == limit


def test_an_identical_text_into_another_target_on_t5_is_encoded_with_its_own_tag(app, t5_reference):
    """MADLAD-400's target is a tag in front of the source: the same text into German, French and German again
    reads its own encoder output each time (the third reuses the first's), each `generate`'s translation."""
    engine = app.registry.models["madlad"].engine
    reuses = engine.m.encoder_reuses._value.get()
    text = "the king is nice today"
    for target in ("de", "fr", "de"):
        got = app.one(model="madlad", input=text, target_lang=target, cache=False)["translation"]
        assert got == t5_reference(text, target)
    assert t5_reference(text, "de") != t5_reference(text, "fr")
    assert engine.m.encoder_reuses._value.get() > reuses


def test_nllb_word_alignments_read_the_target_code_as_the_decoder_did(app):
    """A word-for-word sentence on NLLB: each German word aligns to its English word when the alignment is
    teacher-forced on what the decoder read (the target code first)."""
    item = app.one(model="nllb", input="the quick brown fox", source_lang="en", target_lang="de",
                   return_alignment=True, cache=False)
    (segment,) = item["segments"]
    assert segment["translation"] == "der schnelle braune Fuchs"
    assert segment["alignment"] == [0, 1, 2, 3]


def test_nllb_attention_of_a_given_target_is_transformers_on_the_code_and_its_words(app, nllb_reference):
    """/v1/attention with a target of the client's: the decoder reads the start token, the target code and the
    target's own pieces (no source code, no eos), as `transformers` reads them."""
    tok, hf, _ = nllb_reference
    text, target = "der schnelle braune Fuchs", "the quick brown fox"
    answer = app.post("/v1/attention", {"model": "nllb", "input": text, "target": target, "source_lang": "de",
                                        "target_lang": "en", "layers": [1], "heads": [0, 3]}).json()
    tok.src_lang = "deu_Latn"
    src = tok(text, return_tensors="pt").input_ids
    decoder = [2, tok.convert_tokens_to_ids("eng_Latn"), *tok(target, add_special_tokens=False).input_ids]
    with torch.no_grad():
        out = hf(input_ids=src, decoder_input_ids=torch.tensor([decoder]), output_attentions=True)
    cross = next(m for m in answer["maps"] if m["module"] == "decoder.cross")
    assert cross["key_tokens"][0] == "deu_Latn" and answer["target"] == target
    torch.testing.assert_close(torch.tensor(cross["weights"]), out.cross_attentions[1][0, [0, 3]], atol=1e-5, rtol=0)


def test_the_t5_tag_in_front_of_a_source_covers_none_of_its_words(checkpoints):
    """MADLAD-400's `<2de>` is an ordinary token in front of the source, not a special one: it shows as text when
    the source's ids are decoded, but none of the source's characters are its own. Each word's tokens cover that
    word (what word alignments, HTML tags and file placement read), the first word's too."""
    tokenizer = load(checkpoints["madlad"]).tokenizer
    text = "the quick brown fox"
    ids = tokenizer.source_in(text, (None, "<2de>"))
    assert tokenizer.decode(ids[:1]).strip() == "<2de>"  # the tag decodes as text
    spans = token_spans(tokenizer, ids, text)
    assert spans[0][0] == spans[0][1]  # the tag: no characters of the source
    words = {(m.start(), m.end()) for m in re.finditer(r"\S+", text)}
    covered = [(s, e) for s, e in spans if e > s]
    assert all(any(ws <= s and e <= we for ws, we in words) for s, e in covered), spans
    assert "".join(text[s:e] for s, e in covered) == text.replace(" ", "")
