"""One feature through each protocol that serves it: the OpenAI-style routes (/v1/completions, /v1/classifications,
/v1/embeddings), the Open Inference Protocol (/v2/models/NAME/infer) and LibreTranslate's (/translate,
/download_file). A limit or an option is usually tested on one of them; here the same request goes through each,
and each answer is compared with the one the feature's own tests pin: --max-prompts on every list a request can
hold, an empty prompt, a 64-bit seed, and the refusals the middleware and the routes make in each protocol's
error shape (`{"error": {...}}` on /v1, `{"error": "..."}` on /v2 and LibreTranslate's paths). Every app runs in
this process (`httpx.ASGITransport`) on the tiny fixture models, so that the tests take seconds."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tests.http.test_option_combinations_compat import png
from tserve.service.app import build_app
from tserve.service.settings import Settings

MAX_PROMPTS = 2
KEY = "protocols-key-0123456789"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A language model, an English→German translator and an image classifier, with --max-prompts 2."""
    root = tmp_path_factory.mktemp("protocols")
    served = InProcessApp({"lm": factories.tiny_lm_dir(root / "lm"),
                           "mt": factories.tiny_mt_dir(root / "mt", languages=("en", "de")),
                           "vit": factories.tiny_vit_dir(root / "vit")},
                          gc_freeze=False, max_prompts=MAX_PROMPTS)
    yield served
    served.stop()


def answer(app: InProcessApp, path: str, body: dict) -> tuple[int, dict]:
    resp = app.request("POST", path, json=body)
    return resp.status_code, resp.json()


def assert_openai_error(status_and_body: tuple[int, dict], status: int, says: str = "") -> None:
    status_got, body = status_and_body
    assert status_got == status, body
    assert set(body) == {"error"} and isinstance(body["error"], dict), body
    assert says in body["error"]["message"], body


def assert_flat_error(status_and_body: tuple[int, dict], status: int, says: str = "") -> None:
    status_got, body = status_and_body
    assert status_got == status, body
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert says in body["error"], body


def bytes_tensor(name: str, data: list[str]) -> dict:
    return {"name": name, "datatype": "BYTES", "shape": [len(data)], "data": data}


# ------------------------------------------------------------------------------------------------------------
# --max-prompts: one limit for every list a request can hold, whichever protocol carries it
# ------------------------------------------------------------------------------------------------------------
def test_max_prompts_bounds_prompts_on_v1_and_text_inputs_on_v2(app):
    """Three prompts with --max-prompts 2: /v1/completions refuses them (its tested limit), and so does the
    language model's /v2 text_input tensor, in the protocol's flat shape; two pass on both."""
    prompts = ["Hello", "The quick", "Good morning"]
    assert_openai_error(answer(app, "/v1/completions", {"model": "lm", "prompt": prompts, "max_tokens": 1}), 400,
                        f"the limit is {MAX_PROMPTS}")
    v2 = {"inputs": [bytes_tensor("text_input", prompts)], "parameters": {"max_tokens": 1}}
    assert_flat_error(answer(app, "/v2/models/lm/infer", v2), 400, str(MAX_PROMPTS))
    two = {"inputs": [bytes_tensor("text_input", prompts[:2])], "parameters": {"max_tokens": 1, "temperature": 0}}
    status, body = answer(app, "/v2/models/lm/infer", two)
    assert status == 200 and body["outputs"][0]["shape"] == [2], body


def test_max_prompts_bounds_images_on_v1_classifications_embeddings_and_v2(app):
    """Three images with --max-prompts 2 are refused as base64 JSON on /v1/classifications and /v1/embeddings and
    as BYTES on /v2, each protocol in its own shape (a /v2 pixel batch: tests/http/
    test_option_combinations_compat.py); two images are classified alike on /v1 and /v2."""
    images = [base64.b64encode(png(seed)).decode() for seed in range(3)]
    assert_openai_error(answer(app, "/v1/classifications", {"model": "vit", "images": images}), 400,
                        f"the limit is {MAX_PROMPTS}")
    assert_openai_error(answer(app, "/v1/embeddings", {"model": "vit", "images": images}), 400,
                        f"the limit is {MAX_PROMPTS}")
    assert_flat_error(answer(app, "/v2/models/vit/infer", {"inputs": [bytes_tensor("image", images)]}), 400,
                      str(MAX_PROMPTS))
    status, v1 = answer(app, "/v1/classifications", {"model": "vit", "images": images[:2], "top_k": 1})
    assert status == 200, v1
    status, v2 = answer(app, "/v2/models/vit/infer", {"inputs": [bytes_tensor("image", images[:2])],
                                                      "outputs": [{"name": "label"}]})
    assert status == 200, v2
    assert v2["outputs"][0]["data"] == [d["predictions"][0]["label"] for d in v1["data"]]


def test_max_prompts_bounds_translations_on_v1_v2_and_libretranslate(app):
    """The translator's three inputs are refused on /v1/translations, /v2 and /translate alike."""
    texts = ["Good morning.", "Where is the station?", "The house is small."]
    assert_openai_error(answer(app, "/v1/translations", {"model": "mt", "input": texts}), 400,
                        f"the limit is {MAX_PROMPTS}")
    assert_flat_error(answer(app, "/v2/models/mt/infer", {"inputs": [bytes_tensor("text", texts)]}), 400,
                      str(MAX_PROMPTS))
    assert_flat_error(answer(app, "/translate", {"q": texts, "source": "en", "target": "de"}), 400,
                      f"the limit is {MAX_PROMPTS}")


# ------------------------------------------------------------------------------------------------------------
# The language model's inputs and sampling options, /v1 against /v2
# ------------------------------------------------------------------------------------------------------------
def test_an_empty_prompt_is_refused_on_v2_as_on_v1_though_the_tokenizer_adds_a_bos(app):
    """The fixture's tokenizer encodes "" as its BOS token alone: /v1/completions refuses an empty prompt
    whatever its ids, and /v2 must not generate from the BOS token either."""
    lm = app.registry.models["lm"]
    assert lm.tokenizer.encode("") != [], "the case needs a tokenizer that adds a token to any text"
    assert_openai_error(answer(app, "/v1/completions", {"model": "lm", "prompt": "", "max_tokens": 2}), 400, "empty")
    v2 = {"inputs": [bytes_tensor("text_input", [""])], "parameters": {"max_tokens": 2}}
    assert_flat_error(answer(app, "/v2/models/lm/infer", v2), 400, "text_input")
    mixed = {"inputs": [bytes_tensor("text_input", ["Hello", ""])], "parameters": {"max_tokens": 2}}
    assert_flat_error(answer(app, "/v2/models/lm/infer", mixed), 400, "text_input")


def test_a_64_bit_seed_samples_the_same_text_on_v2_as_on_v1(app):
    """/v1 takes any seed of 64 bits (OpenAI's and vLLM's clients send them); the /v2 `seed` parameter is the
    same sampling seed: the same prompt, temperature and seed give the same text through both."""
    prompt, seed = "The quick brown", 2**40 + 12345
    texts = {}
    for s in (seed, seed + 1):
        status, v1 = answer(app, "/v1/completions", {"model": "lm", "prompt": prompt, "max_tokens": 6,
                                                     "temperature": 1.5, "seed": s})
        assert status == 200, v1
        v2 = {"inputs": [bytes_tensor("text_input", [prompt])],
              "parameters": {"max_tokens": 6, "temperature": 1.5, "seed": s}}
        status, body = answer(app, "/v2/models/lm/infer", v2)
        assert status == 200, body
        texts[s] = (v1["choices"][0]["text"], body["outputs"][0]["data"][0])
        assert texts[s][0] == texts[s][1], texts
    assert_flat_error(answer(app, "/v2/models/lm/infer", {"inputs": [bytes_tensor("text_input", [prompt])],
                                                          "parameters": {"seed": 2**63}}), 400, "seed")


def test_a_request_past_the_context_is_a_400_on_completions_chat_and_v2(app):
    """Prompt plus max_tokens past the model's context (128): /v1/completions checks it before submitting (its
    tested path); chat and /v2 learn it from the engine's submission, which must still be a 400, not a 500."""
    max_tokens = app.registry.models["lm"].max_len + 10
    assert_openai_error(answer(app, "/v1/completions", {"model": "lm", "prompt": "Hello", "max_tokens": max_tokens}),
                        400)
    chat = {"model": "lm", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens}
    status, body = answer(app, "/v1/chat/completions", chat)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    v2 = {"inputs": [bytes_tensor("text_input", ["Hello"])], "parameters": {"max_tokens": max_tokens}}
    assert_flat_error(answer(app, "/v2/models/lm/infer", v2), 400)


def test_the_default_max_tokens_is_held_to_the_servers_limit_on_v2_as_on_v1(tmp_path):
    """--max-tokens-limit 8 and no max_tokens in the request: OpenAI's default of 16 is past the limit, which
    /v1/completions refuses (its tested rule); the /v2 language model, whose default is the same, refuses it too
    instead of generating past the limit, and takes 8."""
    app = InProcessApp({"lm": factories.tiny_lm_dir(tmp_path / "lm")}, gc_freeze=False, max_tokens_limit=8)
    try:
        assert_openai_error(answer(app, "/v1/completions", {"model": "lm", "prompt": "Hello"}), 400, "limit of 8")
        v2 = {"inputs": [bytes_tensor("text_input", ["Hello"])], "parameters": {"ignore_eos": True}}
        assert_flat_error(answer(app, "/v2/models/lm/infer", v2), 400, "limit of 8")
        v2["parameters"] |= {"max_tokens": 8, "temperature": 0}
        status, body = answer(app, "/v2/models/lm/infer", v2)
        assert status == 200 and body["outputs"][1]["data"] == ["length"], body
    finally:
        app.stop()


def test_v2_parameters_each_model_kind_does_not_take_are_refused_not_ignored(app):
    """An option a client sends and the model does not take is a 400 naming it on every kind of model, not a
    translation computed without it (the language model's tested behaviour)."""
    lm = {"inputs": [bytes_tensor("text_input", ["Hello"])], "parameters": {"max_tokens": 1, "bogus": 3}}
    assert_flat_error(answer(app, "/v2/models/lm/infer", lm), 400, "bogus")
    for parameter in ({"bogus": 3}, {"max_tokens": 1}, {"format": "html"}):
        mt = {"inputs": [bytes_tensor("text", ["hello world"])], "parameters": parameter}
        assert_flat_error(answer(app, "/v2/models/mt/infer", mt), 400, next(iter(parameter)))
    status, body = answer(app, "/v2/models/mt/infer", {"inputs": [bytes_tensor("text", ["hello world"])],
                                                       "parameters": {"num_beams": 2, "n": 1}})
    assert status == 200, body


def test_top_k_minus_one_is_no_filter_on_v2_as_on_v1(app):
    """vLLM's clients send top_k -1 for no top-k filter; /v1 takes it as 0 does, and so does /v2: the same seeded
    sample through both, and the same as top_k 0."""
    prompt, seed = "The quick brown", 77
    texts = []
    for top_k in (-1, 0):
        status, v1 = answer(app, "/v1/completions", {"model": "lm", "prompt": prompt, "max_tokens": 6,
                                                     "temperature": 1.5, "seed": seed, "top_k": top_k})
        assert status == 200, v1
        v2 = {"inputs": [bytes_tensor("text_input", [prompt])],
              "parameters": {"max_tokens": 6, "temperature": 1.5, "seed": seed, "top_k": top_k}}
        status, body = answer(app, "/v2/models/lm/infer", v2)
        assert status == 200, body
        texts += [v1["choices"][0]["text"], body["outputs"][0]["data"][0]]
    assert len(set(texts)) == 1, texts


# ------------------------------------------------------------------------------------------------------------
# Refusals made before any model runs, in each protocol's shape
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed():
    """A server with one key allowed one request in flight, no models, and a route that holds its request."""
    app = build_app(Settings(api_keys=[KEY], max_requests_per_key=1), load_models=False)
    release = asyncio.Event()

    @app.get("/held")
    async def held() -> dict:
        await release.wait()
        return {"ok": True}

    return app, release


def test_a_key_at_its_limit_is_refused_in_each_protocols_error_shape(keyed):
    """With the key's one request in flight, its next is a 429 with Retry-After everywhere: OpenAI's shape on
    /v1 (tests/http/test_security.py), the flat one on /v2 (from the middleware) and on /translate (from the
    route, which reads the key from the body)."""
    app, release = keyed
    bearer = {"Authorization": f"Bearer {KEY}"}

    async def go() -> dict[str, httpx.Response]:
        release.clear()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            holder = asyncio.create_task(c.get("/held", headers=bearer))
            await asyncio.sleep(0.05)
            out = {"/v1/completions": await c.post("/v1/completions", json={"prompt": "hi"}, headers=bearer),
                   "/v2/models/lm/infer": await c.post("/v2/models/lm/infer", headers=bearer, json={
                       "inputs": [bytes_tensor("text_input", ["hi"])]}),
                   "/translate": await c.post("/translate", json={"q": "hi", "source": "en", "target": "de",
                                                                  "api_key": KEY})}
            release.set()
            assert (await holder).status_code == 200
            return out

    answers = asyncio.run(go())
    for path, resp in answers.items():
        assert resp.status_code == 429 and resp.headers["retry-after"], (path, resp.text)
    assert answers["/v1/completions"].json()["error"]["code"] == "rate_limit_exceeded"
    for path in ("/v2/models/lm/infer", "/translate"):
        error = answers[path].json()
        assert set(error) == {"error"} and isinstance(error["error"], str) and error["error"], (path, error)


def test_an_unknown_file_is_a_404_in_each_protocols_error_shape(keyed):
    """A file or job that does not exist: /v1's job routes answer OpenAI's shape, LibreTranslate's download route
    (its files' `translatedFileUrl`) the flat one, as every LibreTranslate client reads it."""
    app, _ = keyed

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return (await c.get("/v1/translations/jobs/nope", headers={"Authorization": f"Bearer {KEY}"}),
                    await c.get(f"/download_file/nope.txt?api_key={KEY}"))

    v1, download = asyncio.run(go())
    assert v1.status_code == 404 and isinstance(v1.json()["error"], dict), v1.text
    assert download.status_code == 404 and download.json() == {"error": "no such file"}, download.text
