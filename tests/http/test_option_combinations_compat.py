"""The compatibility surfaces (LibreTranslate's API, the Open Inference Protocol's /v2, the model repository API,
embeddings) where they meet the server's options: API keys sent as a Bearer header, --max-prompts,
--max-input-chars and --max-tokens-limit on /v2 and on a LibreTranslate batch split by detected language, form
bodies with repeated fields, a batch of one text, several models served at once, CORS in front of API keys, and
a translator unloaded and loaded again. Every app runs in this process (`httpx.ASGITransport`) on the committed
fixture models, so that the tests take seconds."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

KEY, OTHER_KEY, ADMIN = "compat-key-0123456789", "compat-key-abcdef", "compat-admin-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
GERMAN, ENGLISH = "der schnelle braune Fuchs springt", "the quick brown fox jumps"
# Detected as English among English and German (tests/http/test_libretranslate.py).
ENGLISH_TEXT = "Where is the station? The train leaves at noon."
MAX_PROMPTS, MAX_INPUT_CHARS, MAX_TOKENS_LIMIT = 3, 100, 16


@pytest.fixture(scope="module")
def translators(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat-translators")
    return {"en-de": factories.tiny_mt_dir(root / "en-de", languages=("en", "de")),
            "de-en": factories.tiny_mt_dir(root / "de-en", reverse=True, languages=("de", "en"))}


@pytest.fixture(scope="module")
def app(translators, tmp_path_factory):
    """Two translators, a language model and an image classifier at once, with keys, CORS and tight limits."""
    root = tmp_path_factory.mktemp("compat")
    served = InProcessApp({**translators, "lm": factories.tiny_lm_dir(root / "lm"),
                           "vit": factories.tiny_vit_dir(root / "vit")},
                          gc_freeze=False, file_dir=str(root / "files"), api_keys=[KEY, OTHER_KEY],
                          cors_origins=[ORIGIN], max_prompts=MAX_PROMPTS, max_input_chars=MAX_INPUT_CHARS,
                          max_tokens_limit=MAX_TOKENS_LIMIT)
    yield served
    served.stop()


def call(app: InProcessApp, path: str, body: dict, status: int = 200, **kwargs) -> dict | list:  # noqa: ANN003
    """POST `body` as JSON with the API key as a Bearer header; the answer's JSON."""
    resp = app.request("POST", path, json=body, headers=BEARER | kwargs.pop("headers", {}), **kwargs)
    assert resp.status_code == status, resp.text
    return resp.json()


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (30, 36, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------------------
# LibreTranslate: the shapes a client sends, and the limits beside language detection
# ------------------------------------------------------------------------------------------------------------
def test_a_libretranslate_list_of_one_text_is_answered_as_a_list(app):
    """`q` as a list is answered with lists whatever its length: a client that batches gets a list back even
    for one text (with alternatives and with detection too), and a plain string gets strings."""
    one = call(app, "/translate", {"q": [GERMAN], "source": "de", "target": "en"})
    assert one == {"translatedText": [ENGLISH]}
    assert call(app, "/translate", {"q": GERMAN, "source": "de", "target": "en"}) == {"translatedText": ENGLISH}
    with_alternatives = call(app, "/translate", {"q": [GERMAN], "source": "de", "target": "en", "alternatives": 1})
    assert with_alternatives["translatedText"] == [ENGLISH]
    assert isinstance(with_alternatives["alternatives"], list) and len(with_alternatives["alternatives"]) == 1
    assert isinstance(with_alternatives["alternatives"][0], list)
    detected = call(app, "/translate", {"q": [GERMAN], "source": "auto", "target": "en"})
    assert detected["translatedText"] == [ENGLISH]
    assert [d["language"] for d in detected["detectedLanguage"]] == ["de"]


def test_a_form_body_takes_alternatives_and_a_repeated_q_as_a_list(app):
    """A form sends every field as text and a list as the field repeated: `alternatives=1` is the number one,
    and two `q` fields are a batch of two, answered as the same request in JSON is."""
    fields = {"q": [GERMAN, "guten Morgen"], "source": "de", "target": "en", "alternatives": "1", "api_key": KEY}
    form = app.request("POST", "/translate", data=fields)
    assert form.status_code == 200, form.text
    as_json = call(app, "/translate", fields | {"alternatives": 1})
    assert form.json() == as_json
    assert as_json["translatedText"][0] == ENGLISH and len(as_json["translatedText"]) == 2
    assert len(as_json["alternatives"]) == 2


def test_a_libretranslate_batch_past_max_prompts_is_refused_even_when_detection_splits_it(app):
    """--max-prompts bounds the request, not each language's share of it: four texts, two German to translate
    and two already English, are refused with a limit of three, though neither part passes it alone."""
    texts = [GERMAN, ENGLISH_TEXT, "guten Morgen", ENGLISH_TEXT]
    refused = call(app, "/translate", {"q": texts, "source": "auto", "target": "en"}, 400)
    assert set(refused) == {"error"} and "limit is 3" in refused["error"]
    answered = call(app, "/translate", {"q": texts[:3], "source": "auto", "target": "en"})
    assert answered["translatedText"][:2] == [ENGLISH, ENGLISH_TEXT]
    assert [d["language"] for d in answered["detectedLanguage"]] == ["de", "en", "de"]


# ------------------------------------------------------------------------------------------------------------
# Open Inference Protocol: the server's limits hold on /v2 as on /v1
# ------------------------------------------------------------------------------------------------------------
def lm_infer(app: InProcessApp, text: str, status: int = 200, **parameters) -> dict:  # noqa: ANN003
    tensor = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [text]}
    return call(app, "/v2/models/lm/infer", {"inputs": [tensor], "parameters": {"temperature": 0} | parameters},
                status)


def test_a_language_models_v2_requests_keep_max_tokens_limit_and_max_input_chars(app):
    """--max-tokens-limit caps the max_tokens parameter, and --max-input-chars the prompt, on /v2 too."""
    lm_infer(app, "Hello world", max_tokens=MAX_TOKENS_LIMIT)
    too_many = lm_infer(app, "Hello world", 400, max_tokens=MAX_TOKENS_LIMIT + 1)
    assert set(too_many) == {"error"} and "max_tokens" in too_many["error"]
    lm_infer(app, "a" * MAX_INPUT_CHARS, max_tokens=1)
    too_long = lm_infer(app, "a" * (MAX_INPUT_CHARS + 1), 400, max_tokens=1)
    assert str(MAX_INPUT_CHARS) in too_long["error"]


def test_a_translators_v2_num_beams_parameter_allows_more_alternatives_than_its_default(app):
    """`num_beams` on /v2 is the request's beam count, as on /v1: n = 3 with num_beams 3 (the checkpoint's own
    is 2) is answered with three alternatives, the best as /v1/translations gives it."""
    tensor = {"name": "text", "datatype": "BYTES", "shape": [1], "data": [ENGLISH]}
    body = {"inputs": [tensor], "parameters": {"n": 3, "num_beams": 3}}
    outputs = {o["name"]: o for o in call(app, "/v2/models/en-de/infer", body)["outputs"]}
    assert outputs["alternatives"]["shape"] == [1, 3]
    v1 = call(app, "/v1/translations", {"model": "en-de", "input": ENGLISH, "num_beams": 3})
    assert outputs["translation"]["data"] == [v1["data"][0]["translation"]]
    call(app, "/v2/models/en-de/infer", {"inputs": [tensor], "parameters": {"n": 3}}, 400)  # 3 > the 2 beams


def test_a_v2_pixel_batch_is_held_to_max_prompts(app):
    """FP32 pixels [N, 1, 28, 28]: N up to --max-prompts, as for images sent as bytes."""

    def pixels(n: int) -> dict:
        return {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [n, 1, 28, 28],
                            "data": [0.25] * (n * 28 * 28)}]}

    answer = call(app, "/v2/models/vit/infer", pixels(MAX_PROMPTS))
    assert next(o for o in answer["outputs"] if o["name"] == "label")["shape"] == [MAX_PROMPTS]
    refused = call(app, "/v2/models/vit/infer", pixels(MAX_PROMPTS + 1), 400)
    assert str(MAX_PROMPTS) in refused["error"]


# ------------------------------------------------------------------------------------------------------------
# Several models at once
# ------------------------------------------------------------------------------------------------------------
def test_image_embeddings_without_a_model_go_to_the_only_image_model_beside_text_ones(app):
    """With three text embedding models and one image model served, an image needs no `model`: only one model
    embeds images. A text still does, as three embed text."""
    image = base64.b64encode(png(1)).decode()
    named = call(app, "/v1/embeddings", {"model": "vit", "image": image})
    unnamed = call(app, "/v1/embeddings", {"image": image})
    assert unnamed["model"] == "vit" and unnamed["data"] == named["data"]
    assert "say which" in call(app, "/v1/embeddings", {"input": "hello"}, 400)["error"]["message"]


def test_cors_preflights_and_refusals_pass_in_front_of_api_keys(app):
    """A browser's preflight carries no key: with keys and CORS on it is answered by CORS (not 401), allowing
    the Authorization header; and a refusal for a missing key still carries the origin, so the page can read
    it."""
    preflight = app.request("OPTIONS", "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    refused = app.request("POST", "/v1/completions", json={"model": "lm", "prompt": "x"}, headers={"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


# ------------------------------------------------------------------------------------------------------------
# A translator unloaded, then loaded again
# ------------------------------------------------------------------------------------------------------------
def test_a_translator_unloaded_and_loaded_again_leaves_and_rejoins_libretranslates_routes(translators, tmp_path):
    """Unloading de-en at run time takes its pair out of /languages and /translate at once; the index still
    names it (unloaded), though the model repository does not hold it; with en-de alone, a German text sent
    `auto` into German is detected as German and comes back as it is. Loaded again from its path, it serves."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    repo = InProcessApp(translators, gc_freeze=False, file_dir=str(tmp_path / "files"), api_keys=[KEY],
                        admin_keys=[ADMIN], allow_load_paths=True)
    try:
        both = [{"code": "de", "name": "German", "targets": ["en"]}, {"code": "en", "name": "English",
                                                                       "targets": ["de"]}]
        assert repo.request("GET", "/languages").json() == both
        repo.post("/v2/repository/models/de-en/unload", headers=admin)
        assert repo.request("GET", "/languages").json() == [{"code": "de", "name": "German", "targets": []},
                                                           {"code": "en", "name": "English", "targets": ["de"]}]
        gone = call(repo, "/translate", {"q": GERMAN, "source": "de", "target": "en"}, 400)
        assert "not served" in gone["error"] or "into en" in gone["error"]
        kept = call(repo, "/translate", {"q": GERMAN, "source": "auto", "target": "de"})
        assert kept["translatedText"] == GERMAN and kept["detectedLanguage"]["language"] == "de"
        index = {e["name"]: e for e in repo.post("/v2/repository/index", headers=admin).json()}
        assert index["de-en"]["state"] == "UNAVAILABLE" and index["de-en"]["reason"] == "unloaded"
        assert index["en-de"]["state"] == "READY"

        loaded = repo.post("/v2/repository/models/de-en/load", {"parameters": {"path": str(translators["de-en"])}},
                           headers=admin)
        assert loaded.json() == {"name": "de-en", "state": "READY"}
        assert repo.request("GET", "/languages").json() == both
        assert call(repo, "/translate", {"q": GERMAN, "source": "de", "target": "en"}) == {"translatedText": ENGLISH}
    finally:
        repo.stop()


def test_max_input_chars_bounds_embeddings_texts_and_language_detection(app):
    """--max-input-chars holds for every text a request brings, as its setting says: an embeddings input and
    LibreTranslate's /detect `q` past it are a 400 in each API's shape, before any tokenizing or ranking."""
    long = "word " * (MAX_INPUT_CHARS // 5 + 1)
    ok = call(app, "/v1/embeddings", {"model": "lm", "input": ["short", "text"]})
    assert len(ok["data"]) == 2
    refused = call(app, "/v1/embeddings", {"model": "lm", "input": ["short", long]}, 400)
    assert refused["error"]["code"] == "input_too_long" and "input 1" in refused["error"]["message"]
    assert call(app, "/detect", {"q": ENGLISH_TEXT})[0]["language"] == "en"
    refused = call(app, "/detect", {"q": long}, 400)
    assert "characters" in refused["error"]


def test_a_gguf_file_is_loaded_by_path_as_a_checkpoint_directory_is(tmp_path):
    """`--allow-load-paths`: a load request's `parameters.path` may name a GGUF file, as `--model` may; it serves,
    and a path that is neither a checkpoint directory nor a GGUF file is a 400."""
    from tests.helpers.gguf_files import write_gguf

    admin = {"Authorization": f"Bearer {ADMIN}"}
    file = write_gguf(factories.hf_family_dir("llama", tmp_path / "llama"), tmp_path / "llama.gguf", "llama")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    repo = InProcessApp({}, gc_freeze=False, admin_keys=[ADMIN], allow_load_paths=True,
                        models_dir=str(tmp_path / "empty"), model_repository=str(tmp_path / "empty"))
    try:
        loaded = repo.post("/v2/repository/models/lm/load", {"parameters": {"path": str(file)}}, headers=admin)
        assert loaded.json() == {"name": "lm", "state": "READY"}
        done = repo.post("/v1/completions", {"model": "lm", "prompt": "Hello", "max_tokens": 3}).json()
        assert done["usage"]["completion_tokens"] == 3
        refused = repo.post("/v2/repository/models/x/load", {"parameters": {"path": str(tmp_path / "notes.txt")}},
                            400, headers=admin)
        assert "GGUF" in refused.json()["error"]
    finally:
        repo.stop()
