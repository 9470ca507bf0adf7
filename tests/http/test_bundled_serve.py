"""What `make serve` serves out of the box (every checkpoint under models/, no --model): English → German and
German → English, so that a German user is answered too: LibreTranslate's `source: auto` and /v1/translations
without `model` send German to tserve-de-en and English to tserve-en-de."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server import ServerProcess

ENGLISH = "Where is the station? Save the document before you close it."
GERMAN = "Wo ist der Bahnhof? Speichern Sie das Dokument, bevor Sie es schließen."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([], tmp_path_factory.mktemp("bundled") / "server.log")
    yield srv.wait_ready()
    srv.stop()


def post(server, path: str, body: dict) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_both_directions_out_of_the_box(server):
    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["tserve-en-de"]["languages"] == {"source": "en", "target": "de"}
    assert cards["tserve-de-en"]["languages"] == {"source": "de", "target": "en"}
    languages = {e["code"]: e["targets"] for e in httpx.get(server.url + "/languages").json()}
    assert languages == {"de": ["en"], "en": ["de"]}
    named = {m: post(server, "/v1/translations", {"model": m, "input": text})["data"][0]["translation"]
             for m, text in (("tserve-en-de", ENGLISH), ("tserve-de-en", GERMAN))}
    assert named["tserve-en-de"] != named["tserve-de-en"]
    for text, source, target, model in ((GERMAN, "de", "en", "tserve-de-en"), (ENGLISH, "en", "de", "tserve-en-de")):
        auto = post(server, "/translate", {"q": text, "source": "auto", "target": target})
        assert auto["detectedLanguage"]["language"] == source and auto["translatedText"] == named[model]
        routed = post(server, "/v1/translations", {"input": text})
        assert routed["models"] == [model] and routed["data"][0]["translation"] == named[model]
