"""LibreTranslate's `/translate` through a pivot language: no served translator has German → French, one has
German → English and another English → French, so the text goes through both, each hop in its model's running
batch, and the answer names the models. (The "French" model is a translator whose checkpoint says en → fr; what
it writes does not matter here, only that the second hop translates what the first wrote.)"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, lexicon_sentences
from tests.helpers.server import ServerProcess

TEXTS = ["der schnelle braune Fuchs", "Guten Morgen wo ist der Bahnhof", "drei Töchter", "der König ist heute schön"]


def pivot_checkpoints(root: Path) -> dict[str, Path]:
    """German → English and English → "French" (a translator whose checkpoint says en → fr): de → fr pivots."""
    de_en = factories.tiny_mt_dir(root / "de-en", reverse=True, languages=("de", "en"))
    en_fr = factories.hf_marian_dir(root / "en-fr")
    config = json.loads((en_fr / "tokenizer_config.json").read_text()) | {"target_lang": "fr"}
    (en_fr / "tokenizer_config.json").write_text(json.dumps(config))
    return {"de-en": de_en, "en-fr": en_fr}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return pivot_checkpoints(tmp_path_factory.mktemp("pivot"))


def _server(checkpoints, log, *extra: str) -> ServerProcess:
    return ServerProcess([*factories.model_flags(checkpoints), *extra], log).wait_ready()


def post(server, path: str, body: dict, status: int = 200) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def test_a_pair_no_model_has_goes_through_english(checkpoints, tmp_path):
    server = _server(checkpoints, tmp_path / "server.log")
    try:
        languages = {e["code"]: e["targets"] for e in httpx.get(server.url + "/languages").json()}
        assert languages == {"de": ["en", "fr"], "en": ["fr"], "fr": []}

        def v1(model: str, texts: list[str]) -> list[str]:
            return [d["translation"] for d in post(server, "/v1/translations", {"model": model, "input": texts})["data"]]

        english = v1("de-en", TEXTS)
        expected = v1("en-fr", english)
        assert_varied(expected)
        answer = post(server, "/translate", {"q": TEXTS, "source": "de", "target": "fr"})
        assert answer["translatedText"] == expected
        assert answer["models"] == [["de-en", "en-fr"]] * len(TEXTS)
        direct = post(server, "/translate", {"q": TEXTS[0], "source": "de", "target": "en"})
        assert direct["translatedText"] == english[0] and "models" not in direct
        auto = post(server, "/translate", {"q": "Guten Morgen, wo ist der Bahnhof?", "source": "auto", "target": "fr"})
        assert auto["detectedLanguage"]["language"] == "de" and auto["models"] == ["de-en", "en-fr"]
    finally:
        server.stop()


def test_another_pivot_language_or_none(checkpoints, tmp_path):
    server = _server(checkpoints, tmp_path / "server.log", "--pivot-language", "es")
    try:
        error = post(server, "/translate", {"q": lexicon_sentences(1)[0], "source": "de", "target": "fr"}, 400)
        assert "de→fr is not served" in error["error"]
    finally:
        server.stop()


def test_v1_translations_route_by_pair_and_pivot_sentence_by_sentence(checkpoints, tmp_path):
    """Without `model`, source_lang → target_lang picks the translator, or two through English: a document's
    sentences each go on to the second model once the first has translated them, and come back in its layout.
    Without languages, the source is detected and the target is the one it translates into directly."""
    server = _server(checkpoints, tmp_path / "server.log")
    try:
        def v1(body: dict, status: int = 200) -> dict:
            return post(server, "/v1/translations", body, status)

        sentences = ["Hallo Welt.", "Guten Morgen wo ist der Bahnhof.", "Der König ist heute schön."]
        english = [d["translation"] for d in v1({"model": "de-en", "input": sentences})["data"]]
        french = [d["translation"] for d in v1({"model": "en-fr", "input": english})["data"]]
        assert_varied(french)
        document = " ".join(sentences)
        answer = v1({"input": [document, sentences[1]], "source_lang": "de", "target_lang": "fr"})
        assert answer["models"] == ["de-en", "en-fr"] and answer["model"] == "en-fr"
        assert [d["translation"] for d in answer["data"]] == [" ".join(french), french[1]]
        assert answer["usage"]["prompt_tokens"] > 0 and answer["usage"]["completion_tokens"] > 0

        direct = v1({"input": sentences[0], "source_lang": "deu", "target_lang": "en-GB"})
        assert direct["models"] == ["de-en"] and direct["data"][0]["translation"] == english[0]
        named = v1({"model": "de-en", "input": sentences[0]})
        assert "models" not in named and named["data"][0]["translation"] == english[0]

        unserved = v1({"input": "hello", "source_lang": "fr", "target_lang": "de"}, 400)["error"]
        assert unserved["code"] == "unsupported_pair" and "de→en" in unserved["message"]
        # Neither model nor languages: the source detected, the target the one it translates into directly.
        detected = v1({"input": "Guten Morgen, wo ist der Bahnhof?"})
        assert detected["models"] == ["de-en"]
        assert v1({"input": "the quick brown fox jumps over the lazy dog"})["models"] == ["en-fr"]
        missing = v1({"input": "bonjour", "source_lang": "fr"}, 400)["error"]
        assert missing["code"] == "model_required" and "translates into nothing served" in missing["message"]
        early = v1({"input": "drei Töchter", "source_lang": "de", "target_lang": "fr", "n": 5, "num_beams": 2}, 400)
        assert early["error"]["code"] == "invalid_n"  # the last model's rules, before the first hop runs
        # A file too: refused before its job starts, not a job that fails after the first hop.
        # (num_beams: only the last hop is asked the request's beams, the first its checkpoint's.)
        refused = httpx.post(server.url + "/v1/translations/files", files={"file": ("a.txt", "drei Töchter\n")},
                             data={"source_lang": "de", "target_lang": "fr", "num_beams": "99"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_num_beams", refused.text
        stream = v1({"input": "drei Töchter", "source_lang": "de", "target_lang": "fr", "stream": True}, 400)
        assert stream["error"]["code"] == "pivot_unsupported"
    finally:
        server.stop()


def test_both_hops_of_a_pivot_answer_from_their_translation_memories(checkpoints, tmp_path):
    """A pivoted request takes the way every translation takes (`ServedTranslator.results_as_ready`): asked again,
    each hop answers its sentences from its model's translation memory, and the answer is the same; with
    `cache` off, neither hop looks."""
    server = _server(checkpoints, tmp_path / "server.log")
    try:
        def hits() -> tuple[float, float]:
            return tuple(server.metric("tserve_translation_memory_hits_total", m, 0.0) for m in ("de-en", "en-fr"))

        body = {"input": ["Der König ist heute schön. Guten Morgen.", "drei Töchter"], "source_lang": "de",
                "target_lang": "fr"}
        first = post(server, "/v1/translations", body)
        assert first["models"] == ["de-en", "en-fr"] and hits() == (0.0, 0.0)
        again = post(server, "/v1/translations", body)
        assert [d["translation"] for d in again["data"]] == [d["translation"] for d in first["data"]]
        assert hits() == (3.0, 3.0)  # three sentences, at each hop
        post(server, "/v1/translations", body | {"cache": False})
        assert hits() == (3.0, 3.0)
    finally:
        server.stop()
