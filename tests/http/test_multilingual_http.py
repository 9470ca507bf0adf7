"""A multilingual translator (NLLB-200, English <-> German in one model) served by a real `tserve serve`
process: each request's languages as users write them, mixed directions in one running batch equal to
`transformers`' `generate` with the target language forced, beams, alternatives, documents, glossaries, the
Open Inference Protocol, and the 400s of languages a model does not have."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, lexicon_sentences
from tests.helpers.server import ServerProcess, concurrently
from tserve.model.checkpoint import load

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")

EN = ["the quick brown fox", "good morning where is the station", "the king is nice today", "three daughters"]
DE = ["der schnelle braune Fuchs", "Guten Morgen wo ist der Bahnhof", "drei Töchter", "Hallo Welt"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("multilingual")
    return {"nllb": factories.hf_nllb_dir(root / "nllb"), "mt": factories.hf_marian_dir(root / "mt")}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    srv = ServerProcess(factories.model_flags(checkpoints), tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers' translation of `text` from `source` to `target` (NLLB codes), greedy or with beams."""
    d = checkpoints["nllb"]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(d).eval()

    def translate(text: str, source: str, target: str, num_beams: int = 1) -> str:
        tok.src_lang = source
        with torch.no_grad():
            out = hf.generate(tok(text, return_tensors="pt").input_ids, num_beams=num_beams, max_new_tokens=40,
                              forced_bos_token_id=tok.convert_tokens_to_ids(target))
        return tok.decode(out[0], skip_special_tokens=True)

    return translate


def post(server, path: str, body: dict, status: int = 200) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def test_models_list_the_languages(server):
    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["nllb"]["language_codes"] == ["eng_Latn", "deu_Latn", "fra_Latn"]
    assert cards["mt"]["languages"] == {"source": "en", "target": "de"} and "language_codes" not in cards["mt"]


def test_both_directions_in_one_batch_equal_generate(server, reference):
    """Languages written every way a client may: ISO 639-1, 639-3, BCP-47 with a region, the model's code."""
    spellings = {"eng_Latn": ["en", "eng", "en-US", "eng_Latn"], "deu_Latn": ["de", "deu", "de-DE", "deu_Latn"]}
    bodies, expected = [], []
    for i, (texts, source, target) in enumerate(((EN, "eng_Latn", "deu_Latn"), (DE, "deu_Latn", "eng_Latn"))):
        for j, text in enumerate(texts):
            beams = 4 if j % 2 else 1
            bodies.append({"model": "nllb", "input": text, "num_beams": beams,
                           "source_lang": spellings[source][(i + j) % 4], "target_lang": spellings[target][j % 4]})
            expected.append(reference(text, source, target, beams))

    got = [a["data"][0]["translation"] for a in concurrently(server, "/v1/translations", bodies)]
    assert got == expected
    assert_varied(got, min_distinct=0.9)
    assert "Fuchs" in got[0] and "fox" in got[4]


def test_the_target_language_is_forced_not_guessed(server, reference):
    """French, which the model never learnt to choose: the answer is what forcing French's code gives, not the
    German the model would pick for an English source by itself."""
    french = [reference(t, "eng_Latn", "fra_Latn") for t in EN[:3]]
    assert french != [reference(t, "eng_Latn", "deu_Latn") for t in EN[:3]]
    got = post(server, "/v1/translations", {"model": "nllb", "input": EN[:3], "source_lang": "en",
                                            "target_lang": "fr"})["data"]
    assert [d["translation"] for d in got] == french


def test_alternatives_documents_glossary_and_oip(server, reference):
    one = post(server, "/v1/translations", {"model": "nllb", "input": "the quick brown fox jumps", "num_beams": 4,
                                            "n": 2, "source_lang": "en", "target_lang": "de"})["data"][0]
    scores = [a["score"] for a in one["alternatives"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    assert one["translation"] == reference("the quick brown fox jumps", "eng_Latn", "deu_Latn", 4)

    document = "Guten Morgen. Wo ist der Bahnhof?"
    whole = post(server, "/v1/translations", {"model": "nllb", "input": document, "source_lang": "de",
                                              "target_lang": "en"})["data"][0]["translation"]
    assert whole == " ".join(reference(s, "deu_Latn", "eng_Latn") for s in ("Guten Morgen.", "Wo ist der Bahnhof?"))

    glossary = post(server, "/v1/translations", {"model": "nllb", "input": "the lazy dog", "source_lang": "en",
                                                 "target_lang": "de", "glossary": {"lazy": "Welt"}})["data"][0]
    assert "Welt" in glossary["translation"]

    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": DE[:2]}],
            "parameters": {"source_lang": "deu", "target_lang": "eng"}}
    outputs = post(server, "/v2/models/nllb/infer", body)["outputs"]
    assert outputs[0]["data"] == [reference(t, "deu_Latn", "eng_Latn") for t in DE[:2]]


def test_the_translation_memory_answers_each_pair_and_option_as_a_fresh_translation_would(server, reference):
    """One text asked of the multilingual model under every source and target it has, greedy and with beams,
    twice: the memory (on by default) answers the second round, and every answer, the first or the memory's, is
    transformers' for that pair and option, never one stored for another pair."""
    text = "the king is nice today"
    codes = {"en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn"}
    asked = [(s, t, beams) for s in codes for t in codes if s != t for beams in (1, 4)]
    expected = [reference(text, codes[s], codes[t], beams) for s, t, beams in asked]
    assert len(set(expected)) >= 4  # the pairs differ in what they give
    hits = server.metric("tserve_translation_memory_hits_total", "nllb", 0.0)
    for _ in range(2):
        got = [post(server, "/v1/translations", {"model": "nllb", "input": text, "source_lang": s, "target_lang": t,
                                                 "num_beams": beams})["data"][0]["translation"]
               for s, t, beams in asked]
        assert got == expected
    assert server.metric("tserve_translation_memory_hits_total", "nllb") - hits >= len(asked)


@pytest.mark.parametrize(("model", "languages", "code", "words"), [
    ("nllb", {"source_lang": "en"}, "missing_language", "give target_lang (one of eng_Latn, deu_Latn, fra_Latn"),
    ("nllb", {"target_lang": "de"}, "missing_language", "give source_lang"),
    ("nllb", {"source_lang": "en", "target_lang": "zh-Hant"}, "unsupported_language", "its languages: eng_Latn"),
    ("nllb", {"source_lang": "xx-1", "target_lang": "de"}, "unsupported_language", "source_lang 'xx-1'"),
    ("mt", {"target_lang": "fr"}, "unsupported_language", "translates en to de"),
])
def test_languages_a_model_does_not_have_are_400s(server, model, languages, code, words):
    error = post(server, "/v1/translations", {"model": model, "input": "good morning"} | languages, 400)["error"]
    assert error["code"] == code and words in error["message"], error


def test_a_one_pair_model_takes_its_own_languages_in_any_spelling(server, checkpoints):
    mt = load(checkpoints["mt"])
    plain = post(server, "/v1/translations", {"model": "mt", "input": "good morning"})["data"][0]["translation"]
    for source, target in (("en", "de"), ("eng", "deu"), ("en-GB", "de-AT")):
        answer = post(server, "/v1/translations", {"model": "mt", "input": "good morning", "source_lang": source,
                                                   "target_lang": target})["data"][0]["translation"]
        assert answer == plain
    assert mt.languages == ("en", "de")


def telling_apart(server, reference) -> tuple[str, str]:
    """An English text the pair model ("mt") and NLLB translate differently, and the pair model's answer."""
    for text in [*EN, *lexicon_sentences(8, seed=5, min_words=2, max_words=6)]:
        marian = post(server, "/v1/translations", {"model": "mt", "input": text})["data"][0]["translation"]
        if marian != reference(text, "eng_Latn", "deu_Latn"):
            return text, marian
    raise AssertionError("the two models translate every candidate alike")


def test_libretranslate_routes_pairs_to_the_pair_model_first_and_the_rest_to_nllb(server, reference):
    """en→de has a one-pair model (opus-mt layout) and goes there; de→en and en→fr only NLLB serves."""
    languages = {entry["code"]: entry["targets"] for entry in httpx.get(server.url + "/languages").json()}
    assert languages == {"en": ["de", "fr"], "de": ["en", "fr"], "fr": ["de", "en"]}

    def translate(q, source, target) -> str:
        return post(server, "/translate", {"q": q, "source": source, "target": target})["translatedText"]

    text, marian = telling_apart(server, reference)
    assert translate(text, "en", "de") == marian
    assert translate(DE[:2], "de", "en") == [reference(t, "deu_Latn", "eng_Latn") for t in DE[:2]]
    assert translate("the quick brown fox", "en", "fr") == reference("the quick brown fox", "eng_Latn", "fra_Latn")
    auto = post(server, "/translate", {"q": "Guten Morgen, wo ist der Bahnhof?", "source": "auto", "target": "en"})
    assert auto["detectedLanguage"]["language"] == "de"
    assert auto["translatedText"] == reference("Guten Morgen, wo ist der Bahnhof?", "deu_Latn", "eng_Latn")
    error = post(server, "/translate", {"q": "x", "source": "en", "target": "ja"}, 400)["error"]
    assert "en→ja is not served" in error


def test_prefer_multilingual_sends_a_shared_pair_to_nllb(checkpoints, reference, tmp_path):
    srv = ServerProcess([*factories.model_flags(checkpoints), "--prefer-multilingual"], tmp_path / "server.log")
    try:
        srv.wait_ready()
        text, _ = telling_apart(srv, reference)
        got = post(srv, "/translate", {"q": text, "source": "en", "target": "de"})["translatedText"]
        assert got == reference(text, "eng_Latn", "deu_Latn")
    finally:
        srv.stop()


def test_attention_and_logit_lens_read_the_languages_asked_for(server, checkpoints):
    """Without a target: the model's own translation in the language asked for (what /v1/translations answers),
    its cross-attention as `transformers` computes it on that source and decoder input."""
    text, languages = "der schnelle braune Fuchs", {"source_lang": "de", "target_lang": "en"}
    body = {"model": "nllb", "input": text, "layers": [1], "heads": [0, 3]} | languages
    answer = post(server, "/v1/attention", body)
    translation = post(server, "/v1/translations", {"model": "nllb", "input": text} | languages)["data"][0]
    assert answer["target"] == translation["translation"] == "the quick brown fox"
    d = checkpoints["nllb"]
    tok = transformers.AutoTokenizer.from_pretrained(d, src_lang="deu_Latn")
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(d, attn_implementation="eager").eval()
    src = tok(text, return_tensors="pt").input_ids
    target = [tok.convert_tokens_to_ids("eng_Latn"), *tok(translation["translation"], add_special_tokens=False).input_ids]
    with torch.no_grad():
        out = hf(input_ids=src, decoder_input_ids=torch.tensor([[2, *target]]), output_attentions=True)
    cross = next(m for m in answer["maps"] if m["module"] == "decoder.cross")
    assert cross["key_tokens"][0] == "deu_Latn"
    torch.testing.assert_close(torch.tensor(cross["weights"]), out.cross_attentions[1][0, [0, 3]], atol=1e-5, rtol=0)

    lens = post(server, "/v1/logit_lens", {"model": "nllb", "input": text, "top_k": 1} | languages)
    last = [p["top"][0]["token"] for p in lens["layers"][-1]["positions"]]
    assert last == load(d).tokenizer.tokens(out.logits[0].argmax(-1).tolist())
    missing = post(server, "/v1/attention", {"model": "nllb", "input": text}, 400)["error"]
    assert missing["code"] == "invalid_attention_request" and "source_lang" in missing["message"]


def test_int8_weights_serve_what_they_compute_alone(checkpoints, tmp_path):
    """`--quantize int8`: a mixed-direction batch answers what the int8 model translates alone, and mostly
    what the float32 model translates."""
    from tserve.model.decoding import translate

    int8, fp32 = load(checkpoints["nllb"], quantize="int8"), load(checkpoints["nllb"])
    tok = int8.tokenizer
    jobs = [(t, "eng_Latn", "deu_Latn") for t in EN] + [(t, "deu_Latn", "eng_Latn") for t in DE]
    srv = ServerProcess(["--model", f"nllb={checkpoints['nllb']}", "--quantize", "int8"], tmp_path / "server.log")
    try:
        srv.wait_ready()

        bodies = [{"model": "nllb", "input": t, "source_lang": s, "target_lang": g} for t, s, g in jobs]
        got = [a["data"][0]["translation"] for a in concurrently(srv, "/v1/translations", bodies)]
    finally:
        srv.stop()
    alone, float32 = [], []
    for text, source, target in jobs:
        src, forced = tok.encode_with_language(text, source), tok.language_codes[target]
        for loaded, out in ((int8, alone), (fp32, float32)):
            (seq,) = translate(loaded, [src], forced_first_token=forced)
            out.append(tok.decode(seq.output_ids))
    assert got == alone
    assert_varied(got)
    assert sum(a == b for a, b in zip(alone, float32, strict=True)) >= 0.75 * len(jobs)


def test_embeddings_read_the_source_language(server, checkpoints):
    """A multilingual encoder's embedding of a text in the language given (the mean of transformers' encoder
    output over the source with that language's code); without one, the tokenizer's own default."""
    text = "der schnelle braune Fuchs"
    d = checkpoints["nllb"]
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(d).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)

    def expected(code: str) -> torch.Tensor:
        tok.src_lang = code
        with torch.no_grad():
            states = hf.model.encoder(input_ids=tok(text, return_tensors="pt").input_ids).last_hidden_state[0]
        return torch.nn.functional.normalize(states.mean(0), dim=-1)

    german = post(server, "/v1/embeddings", {"model": "nllb", "input": text, "source_lang": "de"})["data"][0]
    default = post(server, "/v1/embeddings", {"model": "nllb", "input": text})["data"][0]
    torch.testing.assert_close(torch.tensor(german["embedding"]), expected("deu_Latn"), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(default["embedding"]), expected("eng_Latn"), atol=1e-5, rtol=0)
    assert german["embedding"] != default["embedding"]
    error = post(server, "/v1/embeddings", {"model": "nllb", "input": text, "source_lang": "ja"}, 400)["error"]
    assert "its languages: eng_Latn" in error["message"]
    error = post(server, "/v1/embeddings", {"model": "mt", "input": text, "source_lang": "fr"}, 400)["error"]
    assert "translates en to de" in error["message"]


def test_html_tags_follow_their_words(server):
    answer = post(server, "/v1/translations", {"model": "nllb", "input": "<p>the quick <b>brown</b> fox</p>",
                                               "format": "html", "source_lang": "en", "target_lang": "de"})
    assert answer["data"][0]["translation"] == "<p>der schnelle <b>braune</b> Fuchs</p>"
