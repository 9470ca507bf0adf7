"""The translation request layer between a client and the engine (`service/translation/inputs.py`, `served.py`,
`languages.py`, `routes/translations.py` and `routes/libretranslate.py`) away from its defaults: every limit at
exactly its value and one past it (16 beams and alternatives, 15 LibreTranslate alternatives, a glossary of
--max-glossary-entries terms of 100 characters), --max-input-chars on every text of a batch and not only its last,
LibreTranslate bodies as clients really send them (JSON with a charset, fields in the query string, an empty or
null format, a list holding a non-text), the options a pivoted pair or an HTML page refuses, and the names of
regional languages. Every app runs in this process (`httpx.ASGITransport`) on the committed fixture models."""

from __future__ import annotations

import json

import pytest

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tserve.service.translation.languages import language_name

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

KEY = "request-layer-key-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
GERMAN, ENGLISH = "der schnelle braune Fuchs springt", "the quick brown fox jumps"
MAX_INPUT_CHARS, MAX_GLOSSARY_ENTRIES = 120, 2


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """en→de and de→en (the lexicon fixtures), and a third translator that names its target with a region
    (en→pt-BR; the en→de weights): de→pt-BR is then a pair served only through the English pivot."""
    root = tmp_path_factory.mktemp("request-layer")
    served = InProcessApp({"en-de": factories.tiny_mt_dir(root / "en-de", languages=("en", "de")),
                           "de-en": factories.tiny_mt_dir(root / "de-en", reverse=True, languages=("de", "en")),
                           "en-pt": factories.tiny_mt_dir(root / "en-pt", languages=("en", "pt-BR"))},
                          gc_freeze=False, file_dir=str(root / "files"), api_keys=[KEY],
                          max_input_chars=MAX_INPUT_CHARS, max_glossary_entries=MAX_GLOSSARY_ENTRIES)
    yield served
    served.stop()


def v1(app: InProcessApp, body: dict, status: int = 200) -> dict:
    resp = app.request("POST", "/v1/translations", json=body, headers=BEARER)
    assert resp.status_code == status, resp.text
    return resp.json()


def lt(app: InProcessApp, body: dict, status: int = 200, path: str = "/translate") -> dict | list:
    resp = app.request("POST", path, json={"api_key": KEY} | body)
    assert resp.status_code == status, resp.text
    return resp.json()


def v1_error(app: InProcessApp, body: dict) -> dict:
    error = v1(app, body, 400)["error"]
    assert set(error) >= {"message", "type", "code"}, error
    return error


def lt_error(app: InProcessApp, body: dict, path: str = "/translate") -> str:
    """LibreTranslate's flat error shape: one key, a string."""
    answer = lt(app, body, 400, path)
    assert set(answer) == {"error"} and isinstance(answer["error"], str), answer
    return answer["error"]


# ------------------------------------------------------------------------------------------------------------
# The limits at exactly their values
# ------------------------------------------------------------------------------------------------------------
def test_sixteen_beams_and_sixteen_alternatives_are_the_largest_taken(app):
    """num_beams and n run from 1 to 16 inclusive: 16 of each is answered with up to 16 distinct alternatives,
    17 is a 400 naming the field."""
    answer = v1(app, {"model": "en-de", "input": "good morning", "num_beams": 16, "n": 16})["data"][0]
    assert 1 <= len(answer["alternatives"]) <= 16 and answer["alternatives"][0]["translation"] == answer["translation"]
    assert v1_error(app, {"model": "en-de", "input": "good morning", "num_beams": 17})["code"] == "invalid_num_beams"
    assert v1_error(app, {"model": "en-de", "input": "good morning", "num_beams": 16, "n": 17})["code"] == "invalid_n"


def test_a_refusal_of_n_or_num_beams_names_the_field_as_its_param(app, tmp_path):
    """A client that falls back to plain translations (the translation page) reads which field was refused from
    `param`: n or num_beams past their rules, and beams past the decoder rows of a server with fewer rows than the
    beams asked (--max-running-requests). A refusal about the text names no field."""
    body = {"model": "en-de", "input": "good morning"}
    assert v1_error(app, body | {"n": 5, "num_beams": 2})["param"] == "n"
    assert v1_error(app, body | {"num_beams": 17})["param"] == "num_beams"
    assert "param" not in v1_error(app, body | {"input": "  "})
    two_rows = InProcessApp({"en-de": factories.tiny_mt_dir(tmp_path / "en-de", languages=("en", "de"))},
                            gc_freeze=False, max_running_requests=2)
    try:
        resp = two_rows.request("POST", "/v1/translations", json=body | {"n": 3, "num_beams": 4})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == ("request_too_large", "num_beams") and "2 decoder rows" in error["message"]
        assert two_rows.post("/v1/translations", body).json()["data"][0]["translation"]
    finally:
        two_rows.stop()


def test_libretranslate_takes_fifteen_alternatives_and_refuses_sixteen(app):
    """`alternatives` counts the translations besides the best: 0 to 15, so that with the best they are the 16
    beams /v1/translations allows at most."""
    got = lt(app, {"q": GERMAN, "source": "de", "target": "en", "alternatives": 15})
    assert got["translatedText"] == ENGLISH
    assert len(got["alternatives"]) <= 15 and ENGLISH not in got["alternatives"]
    assert "alternatives" in lt_error(app, {"q": GERMAN, "source": "de", "target": "en", "alternatives": 16})


def test_a_glossary_of_exactly_the_entry_limit_with_terms_of_100_characters_is_taken(app):
    """--max-glossary-entries and the 100 characters of a term are the largest allowed, not the first refused."""
    body = {"model": "en-de", "input": ENGLISH}
    at_limit = {f"term{i}": "Wort" for i in range(MAX_GLOSSARY_ENTRIES)}
    assert v1(app, body | {"glossary": at_limit})["data"][0]["translation"] == GERMAN  # no term occurs
    over = v1_error(app, body | {"glossary": at_limit | {"another": "Wort"}})
    assert over["code"] == "invalid_glossary" and f"the limit is {MAX_GLOSSARY_ENTRIES}" in over["message"]
    assert v1(app, body | {"glossary": {"a" * 100: "Wort"}})["data"][0]["translation"] == GERMAN
    assert v1(app, body | {"glossary": {"fox": "F" * 100}, "max_tokens": 40}, 422)  # fits the rules, not the tokens
    for glossary in ({"a" * 101: "Wort"}, {"fox": "F" * 101}):
        assert "1 to 100 characters" in v1_error(app, body | {"glossary": glossary})["message"]


def test_every_text_of_a_batch_is_held_to_max_input_chars_not_only_the_last(app):
    """--max-input-chars bounds each input: a batch whose first text is too long is refused whatever follows it,
    on /v1/translations (naming the input) and on LibreTranslate's /translate (in its flat shape)."""
    long = "the quick brown fox " * (MAX_INPUT_CHARS // 20 + 1)
    assert len(long) > MAX_INPUT_CHARS
    error = v1_error(app, {"model": "en-de", "input": [long, "good morning"]})
    assert error["code"] == "input_too_long" and "input 0" in error["message"]
    assert "input 1" in v1_error(app, {"model": "en-de", "input": ["good morning", long, "hello world"]})["message"]
    assert "characters" in lt_error(app, {"q": [long, ENGLISH], "source": "en", "target": "de"})
    assert lt(app, {"q": [ENGLISH, "good morning"], "source": "en", "target": "de"})["translatedText"][0] == GERMAN


# ------------------------------------------------------------------------------------------------------------
# LibreTranslate's bodies as clients send them
# ------------------------------------------------------------------------------------------------------------
def test_a_json_body_with_a_charset_is_read_as_json(app):
    """`application/json; charset=utf-8` (what many HTTP clients send) is JSON as plain `application/json` is,
    on /translate and /detect alike."""
    headers = {"Content-Type": "application/json; charset=utf-8"}
    body = {"q": [GERMAN, "guten Morgen"], "source": "de", "target": "en", "api_key": KEY}
    resp = app.request("POST", "/translate", content=json.dumps(body).encode(), headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json() == lt(app, body)
    detect = app.request("POST", "/detect", content=json.dumps({"q": GERMAN, "api_key": KEY}), headers=headers)
    assert detect.status_code == 200, detect.text
    assert detect.json() == lt(app, {"q": GERMAN}, path="/detect") and detect.json()[0]["language"] == "de"


def test_fields_in_the_query_string_count_as_the_bodys(app):
    """Fields may come in the query string (the key too): a client that puts source, target and api_key in the
    URL and q in the form is answered as if all were in the body."""
    resp = app.request("POST", f"/translate?source=de&target=en&api_key={KEY}", data={"q": GERMAN})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"translatedText": ENGLISH}
    detect = app.request("POST", f"/detect?api_key={KEY}", data={"q": GERMAN})
    assert detect.status_code == 200 and detect.json()[0]["language"] == "de", detect.text


def test_an_empty_or_null_format_is_text(app):
    """`format` left empty (a form's blank field) or null is the default, text, not an unsupported format."""
    form = app.request("POST", "/translate", data={"q": GERMAN, "source": "de", "target": "en", "format": "",
                                                   "api_key": KEY})
    assert form.status_code == 200 and form.json() == {"translatedText": ENGLISH}, form.text
    assert lt(app, {"q": GERMAN, "source": "de", "target": "en", "format": None}) == {"translatedText": ENGLISH}
    assert "xml" in lt_error(app, {"q": GERMAN, "source": "de", "target": "en", "format": "xml"})


@pytest.mark.parametrize("q", [[GERMAN, 3], [GERMAN, None], [["nested"]], [{"text": GERMAN}]])
def test_a_q_list_holding_a_non_text_is_a_400_in_libretranslates_shape(app, q):
    """Every element of a `q` list must be a text: anything else is the client's error (400, `{"error": ...}`),
    never a server error."""
    assert "q" in lt_error(app, {"q": q, "source": "de", "target": "en"})


# ------------------------------------------------------------------------------------------------------------
# Options a route or a format cannot answer are refused, not dropped
# ------------------------------------------------------------------------------------------------------------
def test_a_pivoted_pair_refuses_return_alignment_rather_than_answer_without_it(app):
    """de→pt-BR goes through English over two models: its translation is answered, but return_alignment (like
    stream and return_attention) is a 400 that says to name one model, not a 200 without segments."""
    body = {"input": GERMAN, "source_lang": "de", "target_lang": "pt-BR"}
    plain = v1(app, body)
    assert plain["models"] == ["de-en", "en-pt"] and plain["data"][0]["translation"] == GERMAN
    for option in ({"return_alignment": True}, {"stream": True}, {"return_attention": {"layers": [0]}}):
        assert v1_error(app, body | option)["code"] == "pivot_unsupported", option
    named = v1(app, {"model": "de-en", "input": GERMAN, "return_alignment": True})["data"][0]
    assert named["segments"][0]["alignment"] and named["translation"] == ENGLISH


def test_an_html_page_refuses_return_attention(app):
    """format html answers whole pages: return_attention (maps of one sentence's tokens) is a 400 with it, as
    stream is, while the page alone and the text with return_attention are answered."""
    page = "<p>the quick <b>brown</b> fox</p>"
    for option in ({"return_attention": {"layers": [0]}}, {"stream": True}):
        assert v1_error(app, {"model": "en-de", "input": page, "format": "html"} | option)["code"] == "invalid_format"
    assert v1(app, {"model": "en-de", "input": page, "format": "html"})["data"][0]["translation"].startswith("<p>")
    text = v1(app, {"model": "en-de", "input": ENGLISH, "num_beams": 1, "return_attention": {"layers": [0]}})
    assert text["data"][0]["attention"]["maps"]


# ------------------------------------------------------------------------------------------------------------
# Language names
# ------------------------------------------------------------------------------------------------------------
def test_a_regional_language_is_named_with_its_region(app):
    """A code with a region (a translator into pt-BR) is named by its base language with the code, so that
    pt-BR is told apart from Portuguese; plain codes keep the plain name, unknown ones their code."""
    assert language_name("pt-BR") == "Portuguese (pt-BR)" and language_name("pt_BR") == "Portuguese (pt_BR)"
    assert language_name("de") == "German" and language_name("DE") == "German"
    assert language_name("xx") == "xx"
    resp = app.request("GET", "/languages")
    assert resp.status_code == 200, resp.text
    listed = {entry["code"]: entry for entry in resp.json()}
    assert listed["pt-BR"]["name"] == "Portuguese (pt-BR)" and listed["de"]["name"] == "German"
    assert listed["de"]["targets"] == ["en", "pt-BR"] and listed["en"]["targets"] == ["de", "pt-BR"]


def test_every_short_code_a_models_language_can_take_has_a_name():
    """`/languages` names each language by the short code LibreTranslate's clients use (`short_code`): ISO 639-1
    where the language has one, and `zt` for Traditional Chinese (NLLB's `zho_Hant`), which LibreTranslate names
    "Chinese (traditional)". Every such code has its English name, not the code in its place."""
    from tserve.model.language_codes import ISO_639_3, short_code

    for three in ISO_639_3.values():
        code = short_code(f"{three}_Latn")
        assert language_name(code) != code, (three, code)
    assert short_code("zho_Hant") == "zt" and language_name("zt") == "Chinese (traditional)"
