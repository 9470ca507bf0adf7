"""LibreTranslate's API through a real server, driven by the real `libretranslatepy` client and by JSON: two
translators routed by their language pair (the bundled English→German one, and a German→English one trained
in the fixture on the lexicon, whose answers are known word for word), language detection, HTML,
alternatives, keys in the body, and errors in LibreTranslate's shape."""

from __future__ import annotations

import asyncio
import re
import urllib.error

import httpx
import pytest
from libretranslatepy import LibreTranslateAPI

from tests.helpers import factories
from tests.helpers.fixture_training import LEXICON, assert_greedy_margins
from tests.helpers.server import ServerProcess
from tests.http.test_html import BUNDLED, assert_same_markup
from tserve.model.checkpoint import load
from tserve.service.app import build_app
from tserve.service.settings import Settings

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

KEY = "lt-key-0123456789"
GERMAN = "der schnelle braune Fuchs springt"
ENGLISH = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def de_en(tmp_path_factory):
    return factories.tiny_mt_dir(tmp_path_factory.mktemp("de-en"), reverse=True, languages=("de", "en"))


@pytest.fixture(scope="module")
def server(de_en, tmp_path_factory):
    lm = factories.tiny_lm_dir(tmp_path_factory.mktemp("lm"))
    srv = ServerProcess(["--model", f"en-de={BUNDLED}", "--model", f"de-en={de_en}", "--model", f"lm={lm}"],
                        tmp_path_factory.mktemp("logs") / "server.log",
                        env={"TSERVE_API_KEYS": KEY, "TSERVE_MAX_REQUESTS_PER_KEY": "2"}).wait_ready()
    yield srv
    srv.stop()


def lt(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/translate", json={"api_key": KEY} | body, timeout=120)


def translations(server, **body) -> dict:
    resp = httpx.post(server.url + "/v1/translations", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]


def test_the_fixture_translates_the_german_words_back_with_margins(de_en):
    """What the tests below expect of the de→en fixture, held by margins that no kernel's rounding closes."""
    assert " ".join(LEXICON[w] for w in ENGLISH.split()) == GERMAN
    assert_greedy_margins(load(de_en), GERMAN, ENGLISH)


def test_the_libretranslatepy_client(server):
    client = LibreTranslateAPI(server.url, api_key=KEY)
    # de→en is the fixture: the lexicon, word for word; en→de is the bundled translator.
    assert client.translate(GERMAN, "de", "en") == ENGLISH
    assert " ".join(LEXICON[w] for w in ENGLISH.split()) == GERMAN
    sentence = "Where is the station?"
    assert client.translate(sentence, "en", "de") == translations(server, model="en-de", input=sentence)["translation"]
    assert client.languages() == [{"code": "de", "name": "German", "targets": ["en"]},
                                  {"code": "en", "name": "English", "targets": ["de"]}]
    for text, language in ((GERMAN, "de"), ("Where is the station? The train leaves at noon.", "en")):
        found = client.detect(text)
        assert [d["language"] for d in found] == [language, "en" if language == "de" else "de"]
        assert 50 < found[0]["confidence"] <= 100 and abs(sum(d["confidence"] for d in found) - 100) < 0.1
    with pytest.raises(urllib.error.HTTPError) as err:  # no key: 403, in LibreTranslate's shape
        LibreTranslateAPI(server.url).translate(GERMAN, "de", "en")
    assert err.value.code == 403


def test_form_and_json_bodies_list_q_alternatives_and_auto(server):
    form = httpx.post(server.url + "/translate", data={"q": GERMAN, "source": "de", "target": "en", "api_key": KEY})
    assert form.status_code == 200 and form.json() == {"translatedText": ENGLISH}
    texts = [GERMAN, "Guten Morgen"]
    assert lt(server, q=texts, source="de", target="en").json() == {"translatedText": [ENGLISH, "good morning"]}

    # alternatives: that many besides the best, as /v1/translations' n = alternatives + 1 answers them.
    sentence = "Open the file and choose a printer."
    got = lt(server, q=sentence, source="en", target="de", alternatives=2).json()
    want = translations(server, model="en-de", input=sentence, n=3, num_beams=4)
    assert got["translatedText"] == want["translation"]
    assert got["alternatives"] == [a["translation"] for a in want["alternatives"][1:]]
    assert 1 <= len(got["alternatives"]) <= 2 and got["translatedText"] not in got["alternatives"]
    listed = lt(server, q=texts, source="de", target="en", alternatives=1).json()
    assert len(listed["alternatives"]) == 2 and all(isinstance(a, list) for a in listed["alternatives"])

    # auto: each text's language is detected; a text already in the target language comes back as it is.
    english = "Where is the station? The train leaves at noon."
    got = lt(server, q=[GERMAN, english], source="auto", target="en").json()
    assert got["translatedText"] == [ENGLISH, english]
    assert [d["language"] for d in got["detectedLanguage"]] == ["de", "en"]
    assert all(0 <= d["confidence"] <= 100 for d in got["detectedLanguage"])
    single = lt(server, q=english, source="auto", target="de").json()
    assert single["detectedLanguage"]["language"] == "en"
    assert single["translatedText"] == translations(server, model="en-de", input=english)["translation"]


def test_html_keeps_the_markup(server):
    page = '<p>Click <b>Save</b> to keep your <a href="save.html">changes</a>.</p>'
    got = lt(server, q=page, source="en", target="de", format="html").json()["translatedText"]
    assert_same_markup(got, page)
    assert got == translations(server, model="en-de", input=page, format="html")["translation"]
    fixture = lt(server, q="<p>der <b>schnelle</b> braune <i>Fuchs</i></p>", source="de", target="en",
                 format="html").json()
    # The route reaches the pair's own translator (placement itself: tests/http/test_html.py).
    assert_same_markup(fixture["translatedText"], "<p>der <b>schnelle</b> braune <i>Fuchs</i></p>")
    assert re.sub(r"<[^>]+>", "", fixture["translatedText"]).split() == "the quick brown fox".split()


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"q": "Hello", "source": "en", "target": "fr"}, 400, "en→fr is not served"),
    ({"q": "Hello", "source": "fr", "target": "de"}, 400, "fr→de is not served"),
    ({"q": "Hallo", "source": "auto", "target": "fr"}, 400, "into fr"),
    ({"q": "", "source": "en", "target": "de"}, 400, "missing q"),
    ({"q": [], "source": "en", "target": "de"}, 400, "missing q"),
    ({"q": ["Hello", " "], "source": "en", "target": "de"}, 400, "empty"),
    ({"q": "Hello", "target": "de"}, 400, "missing source"),
    ({"q": "Hello", "source": "en", "target": "de", "format": "xml"}, 400, "xml format"),
    ({"q": "Hello", "source": "en", "target": "de", "alternatives": -1}, 400, "alternatives"),
    ({"q": "Hello", "source": "en", "target": "de", "alternatives": "two"}, 400, "alternatives"),
    ({"q": "Hello", "source": "en", "target": "de", "api_key": "wrong"}, 403, "invalid API key"),
])
def test_errors_in_libretranslates_shape(server, body, status, says):
    resp = httpx.post(server.url + "/translate", json={"api_key": KEY} | body, timeout=60)
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and says in resp.json()["error"], resp.text


def test_keys_in_the_body_or_the_header_and_429_at_the_per_key_limit(server):
    url = server.url
    assert httpx.post(url + "/translate", json={"q": GERMAN, "source": "de", "target": "en"}).status_code == 403
    assert httpx.post(url + "/detect", data={"q": GERMAN}).status_code == 403
    bearer = httpx.post(url + "/translate", json={"q": GERMAN, "source": "de", "target": "en"},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.json() == {"translatedText": ENGLISH}
    # /languages and /frontend/settings are open, as LibreTranslate's UI reads them before it has a key.
    assert httpx.get(url + "/languages").status_code == httpx.post(url + "/languages").status_code == 200
    settings = httpx.get(url + "/frontend/settings").json()
    assert settings["keyRequired"] is True and settings["apiKeys"] is True and settings["charLimit"] > 0
    assert settings["language"]["source"]["code"] in ("de", "en")

    # Two requests of this key in flight at most: the rest get 429 with Retry-After, in LibreTranslate's shape.
    long_text = " ".join(["The printer in the office on the second floor is out of paper again."] * 12)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(c.post(url + "/translate", data={
                "q": long_text, "source": "en", "target": "de", "api_key": KEY}) for _ in range(6)))

    answers = asyncio.run(burst())
    refused = [r for r in answers if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in answers)
    assert all(r.headers["retry-after"] and set(r.json()) == {"error"} for r in refused)
    assert len(answers) - len(refused) >= 2


def test_models_name_their_languages_and_translations_without_a_model_go_by_language(server):
    """Two translators: /v1/translations without `model` detects the source and goes to the one that reads it;
    a target none of them writes is a 400 that lists the pairs."""
    headers = {"Authorization": f"Bearer {KEY}"}
    cards = httpx.get(server.url + "/v1/models", headers=headers).json()["data"]
    assert {c["id"]: c.get("languages") for c in cards} == {
        "en-de": {"source": "en", "target": "de"}, "de-en": {"source": "de", "target": "en"}, "lm": None}
    for text, model in (("Where is the station? Save the document.", "en-de"),
                        ("Wo ist der Bahnhof? Speichern Sie das Dokument.", "de-en")):
        routed = httpx.post(server.url + "/v1/translations", json={"input": text}, headers=headers).json()
        named = httpx.post(server.url + "/v1/translations", json={"input": text, "model": model}, headers=headers)
        assert routed["models"] == [model] and routed["data"] == named.json()["data"]
    resp = httpx.post(server.url + "/v1/translations", json={"input": "Hello", "target_lang": "fr"}, headers=headers)
    assert resp.status_code == 400 and "en→de" in resp.text and "de→en" in resp.text


def test_a_server_without_keys_or_models_yet():
    async def go() -> list[httpx.Response]:
        app = build_app(Settings(), load_models=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.post("/translate", data={"q": "Hi", "source": "en", "target": "de"}),
                    await c.get("/frontend/settings")]

    translate, settings = asyncio.run(go())
    assert translate.status_code == 503 and set(translate.json()) == {"error"} and translate.headers["retry-after"]
    assert settings.status_code == 503
