"""The request schemas' bounds at their documented edges and the inspection routes' answers to non-default
selections: a bound of 0-2, "up to 4" or "at most 5" takes its edge value and refuses the next one; `top_k: -1` is
"no top-k filter" as 0 is; `structured_outputs` takes exactly one constraint even when one of them is
`json_object`; a JSON boolean is refused wherever a number goes, as OpenAI refuses it; `return_attention`'s weight
bound (--max-attention-floats) admits a selection of exactly the limit; `/v1/embeddings` refuses text beside a
list of images for an image model; `/v1/logit_lens`, `/v1/attention` and `return_attention` answer the layers in
the order asked and refuse a layer named twice; the lens has its default `top_k`; `/v1/attention`'s JSON and
BertViz answers of a language model carry only the fields that model has. Every app runs in this process
(`httpx.ASGITransport`) on the tiny committed models, so that the tests take seconds."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp

# return_attention of one token-id prompt of PROMPT_IDS with MAX_TOKENS tokens, all heads of two layers:
# 2 layers x 4 heads x MAX_TOKENS query rows x (prompt + MAX_TOKENS) keys, the bound set to exactly that.
PROMPT_IDS = [5, 6, 7]
MAX_TOKENS = 5
LAYERS, HEADS = [0, 1], [0, 1, 2, 3]
AT_THE_LIMIT = len(LAYERS) * len(HEADS) * MAX_TOKENS * (len(PROMPT_IDS) + MAX_TOKENS)
TEXT = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("request-layer")
    served = InProcessApp({"lm": factories.tiny_lm_dir(root / "lm"), "vit": factories.tiny_vit_dir(root / "vit")},
                          max_attention_floats=AT_THE_LIMIT)
    yield served
    served.stop()


def png(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def complete(app: InProcessApp, status: int = 200, **fields) -> dict:  # noqa: ANN003 - body fields
    return app.post("/v1/completions", {"model": "lm", "prompt": "Hello", "max_tokens": 4} | fields,
                    status=status).json()


# ------------------------------------------------------------------------------------------------------------
# Sampling fields at the edges the API documents
# ------------------------------------------------------------------------------------------------------------
def test_temperature_two_is_the_top_of_its_range_and_just_above_is_refused(app):
    """The docs say temperature 0-2: 2 itself samples (a client at the edge of the range gets an answer), a
    little more is a 400 that names the field."""
    assert complete(app, temperature=2.0, seed=1)["choices"][0]["finish_reason"] in ("stop", "length")
    error = complete(app, 400, temperature=2.01)["error"]
    assert "temperature" in error["message"]


BOOLEANS_FOR_NUMBERS = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, True]}, "prompt"),
    ("/v1/completions", {"prompt": "Hello", "logit_bias": {"5": True}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hello", "return_attention": {"layers": [True]}}, "return_attention.layers"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "temperature": False},
     "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "priority": False}, "priority"),
    ("/v1/embeddings", {"input": "Hello", "dimensions": True}, "dimensions"),
    ("/v1/translations", {"input": "Hello", "num_beams": True}, "num_beams"),
    ("/v1/attention", {"input": "Hello", "heads": [False]}, "heads"),
    ("/v1/logit_lens", {"input": "Hello", "top_k": True}, "top_k"),
    ("/v1/classifications", {"model": "vit", "image": png(4), "top_k": True}, "top_k"),
]


@pytest.mark.parametrize(("path", "body", "field"), BOOLEANS_FOR_NUMBERS,
                         ids=[f"{path.removeprefix('/v1/')}-{field}" for path, _, field in BOOLEANS_FOR_NUMBERS])
def test_a_boolean_for_a_number_is_refused_with_400_naming_the_field(app, path, body, field):
    """OpenAI refuses `"max_tokens": true` ("expected an integer, but got a boolean"): a boolean is not 1 or 0
    to a /v1 route either, in a number field, a list of numbers or an object of numbers."""
    error = app.post(path, {"model": "lm"} | body, status=400).json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    assert error["message"].startswith(f"{field}: expected ") and "but got a boolean" in error["message"]


def test_max_tokens_reads_a_whole_float_and_a_digit_string_but_not_a_boolean(app):
    """Only booleans are refused: 2.0 and "2" are still read as 2, as pydantic reads them."""
    for asked in (2.0, "2"):
        answer = complete(app, max_tokens=asked, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 2, asked
    assert "max_tokens" in complete(app, 400, max_tokens=True)["error"]["message"]


def test_four_stop_strings_are_taken_and_a_fifth_is_refused(app):
    """"stop (string or up to 4)": four stop strings are a valid request that stops at the first one met;
    five are a 400."""
    free = complete(app, temperature=0, max_tokens=8)["choices"][0]["text"]
    assert len(free) >= 2
    stops = ["zzzq", "qqqz", "xxxj", free[1:3]]
    cut = complete(app, temperature=0, max_tokens=8, stop=stops)["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == free[: free.index(free[1:3])]
    complete(app, 400, temperature=0, stop=[*stops, "jjjx"])


def test_top_k_minus_one_samples_as_no_top_k_filter(app):
    """vLLM's convention, documented: 0 or -1 is no top-k filter, so a seeded sample with -1 is the one with 0;
    -2 is refused."""
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "seed": 17}
    unfiltered = complete(app, **body, top_k=0)["choices"][0]["text"]
    assert complete(app, **body, top_k=-1)["choices"][0]["text"] == unfiltered
    complete(app, 400, **body, top_k=-2)


def test_chat_top_logprobs_of_five_list_five_alternatives_and_six_is_refused(app):
    """top_logprobs runs 0-5 (as OpenAI's did): five is served and every token lists five alternatives; six is
    a 400."""
    body = {"model": "lm", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True}
    choice = app.post("/v1/chat/completions", body | {"top_logprobs": 5}).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == 5 for entry in content)
    app.post("/v1/chat/completions", body | {"top_logprobs": 6}, status=400)


def test_json_object_beside_another_structured_output_is_refused(app):
    """structured_outputs takes exactly one constraint: `json_object` counts as one, so beside a regex the
    request is a 400 rather than an answer held to only one of the two."""
    error = complete(app, 400, structured_outputs={"regex": "ab", "json_object": True})["error"]
    assert "exactly one" in error["message"]
    complete(app, 400, structured_outputs={"choice": ["a", "b"], "json_object": True})
    assert complete(app, structured_outputs={"regex": "ab"})["choices"][0]["text"] == "ab"


# ------------------------------------------------------------------------------------------------------------
# return_attention's weight bound at exactly the limit
# ------------------------------------------------------------------------------------------------------------
def test_return_attention_of_exactly_the_weight_limit_is_served(app):
    """--max-attention-floats is the most weights a request may ask for: a selection that could return exactly
    that many is answered with its maps; one more generated token (more rows and keys) is refused."""
    body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_attention": {"layers": LAYERS, "heads": HEADS}}
    maps = complete(app, **body)["choices"][0]["attention"]["maps"]
    assert [m["layer"] for m in maps] == LAYERS
    assert all(len(m["weights"]) == len(HEADS) for m in maps)
    refused = complete(app, 400, **body | {"max_tokens": MAX_TOKENS + 1})["error"]
    assert refused["code"] == "too_many_weights" and str(AT_THE_LIMIT) in refused["message"]


# ------------------------------------------------------------------------------------------------------------
# Embeddings: text and images in one request
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("images", [{"image": png(0)}, {"images": [png(0), png(1)]}], ids=["image", "images"])
@pytest.mark.parametrize("model", [{"model": "vit"}, {}], ids=["named", "unnamed"])
def test_text_beside_images_is_refused_for_either_image_field(app, images, model):
    """'input' is text, 'image' / 'images' are pictures: a body with both is ambiguous, so it is a 400 whichever
    image field holds the pictures (not the images embedded and the text dropped)."""
    error = app.post("/v1/embeddings", {"input": "hello"} | images | model, status=400).json()["error"]
    assert error["code"] == "invalid_input" and "not both" in error["message"]
    answer = app.post("/v1/embeddings", images | model).json()  # the images alone are fine
    assert len(answer["data"]) == len(images.get("images", [0]))


# ------------------------------------------------------------------------------------------------------------
# The logit lens: layer order and the default top_k
# ------------------------------------------------------------------------------------------------------------
def test_lens_layers_come_back_in_the_order_asked_each_the_layer_it_names(app):
    """A selection out of order: the answer lists the layers as asked, and each entry is that layer's lens (the
    same entries the whole lens has for it), so a client can zip its selection with the answer."""
    whole = app.post("/v1/logit_lens", {"model": "lm", "input": TEXT, "top_k": 2}).json()["layers"]
    picked = app.post("/v1/logit_lens", {"model": "lm", "input": TEXT, "top_k": 2, "layers": [2, 0]}).json()
    assert [entry["layer"] for entry in picked["layers"]] == [2, 0]
    assert picked["layers"][0] == whole[2] and picked["layers"][1] == whole[0]
    assert whole[2] != whole[0], "the layers must differ to tell"


def test_attention_layers_come_back_in_the_order_asked_each_the_layer_it_names(app):
    """As the lens does: `/v1/attention` (JSON and BertViz) and `return_attention` list the layers as asked, so a
    client can zip its selection with the answer."""
    body = {"model": "lm", "input": "hello", "heads": [0]}  # short: within --max-attention-floats
    whole = app.post("/v1/attention", body).json()["maps"]
    picked = app.post("/v1/attention", body | {"layers": [1, 0]}).json()["maps"]
    assert [m["layer"] for m in picked] == [1, 0]
    assert picked[0] == whole[1] and picked[1] == whole[0]
    bertviz = app.post("/v1/attention", body | {"layers": [1, 0], "format": "bertviz"}).json()["attention"]
    assert bertviz == [[whole[1]["weights"]], [whole[0]["weights"]]]
    maps = complete(app, prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                    return_attention={"layers": [1, 0], "heads": [0]})["choices"][0]["attention"]["maps"]
    assert [m["layer"] for m in maps] == [1, 0]


@pytest.mark.parametrize(("path", "body", "code"), [
    ("/v1/attention", {"input": "hello", "layers": [1, 0, 1]}, "invalid_attention_request"),
    ("/v1/logit_lens", {"input": TEXT, "layers": [1, 0, 1]}, "invalid_lens_request"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "return_attention": {"layers": [1, 0, 1]}},
     "invalid_attention_request"),
], ids=["attention", "logit_lens", "return_attention"])
def test_a_layer_named_twice_is_a_400_naming_it(app, path, body, code):
    """One rule for every route that takes `layers`: a layer named twice is a 400 that names it, rather than
    answered once on one route and refused on another."""
    error = app.post(path, {"model": "lm"} | body, status=400).json()["error"]
    assert error["code"] == code and "layers [1] named more than once" in error["message"]


def test_lens_without_top_k_lists_five_tokens_per_position(app):
    """top_k defaults to 5 (the schema's documented default): every position of every layer lists five next
    tokens, most likely first."""
    answer = app.post("/v1/logit_lens", {"model": "lm", "input": TEXT, "layers": [1]}).json()
    for position in answer["layers"][0]["positions"]:
        probs = [t["prob"] for t in position["top"]]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True)


# ------------------------------------------------------------------------------------------------------------
# /v1/attention: only the fields the model has
# ------------------------------------------------------------------------------------------------------------
def test_a_language_models_attention_answers_carry_only_its_own_fields(app):
    """A language model has no translation target and no encoder: its JSON answer is the model and the maps
    (no `target: null`), and its BertViz answer the decoder's `attention` and `tokens` (no null
    encoder_/decoder_/cross_ fields, which BertViz would read as an encoder-decoder)."""
    body = {"model": "lm", "input": "hello", "layers": [0], "heads": [0]}
    assert set(app.post("/v1/attention", body).json()) == {"model", "maps"}
    bertviz = app.post("/v1/attention", body | {"format": "bertviz"}).json()
    assert set(bertviz) == {"model", "attention", "tokens"}
    image = app.post("/v1/attention", {"model": "vit", "image": png(2), "layers": [0], "heads": [0]}).json()
    assert set(image) == {"model", "maps"}


# ------------------------------------------------------------------------------------------------------------
# /v1/embeddings: OpenAI's `dimensions`, and the form fields of a multipart request
# ------------------------------------------------------------------------------------------------------------
def test_embeddings_take_their_own_dimensions_and_refuse_another_length(app):
    """OpenAI's `dimensions` asks for vectors of that length. These models cannot shorten theirs (not trained for
    it), so their own length is served as without it and any other is a 400 that says the length, never vectors
    of another length than asked, nor the parameter silently ignored."""
    plain = app.post("/v1/embeddings", {"model": "lm", "input": TEXT}).json()["data"][0]["embedding"]
    same = app.post("/v1/embeddings", {"model": "lm", "input": TEXT, "dimensions": len(plain)}).json()
    assert same["data"][0]["embedding"] == plain
    for asked in (len(plain) // 2, len(plain) + 1):
        error = app.post("/v1/embeddings", {"model": "lm", "input": TEXT, "dimensions": asked}, status=400).json()
        assert error["error"]["code"] == "unsupported_dimensions" and str(len(plain)) in error["error"]["message"]
    app.post("/v1/embeddings", {"model": "lm", "input": TEXT, "dimensions": 0}, status=400)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/classifications"])
def test_a_multipart_images_form_fields_are_read_as_a_json_bodys(app, path):
    """A multipart upload's form fields are the JSON body's: `priority` is read and checked (one past its range
    is a 400, as in JSON), and on embeddings `dimensions` too, rather than dropped without a word."""
    image = base64.b64decode(png(3))
    files = {"file": ("x.png", image, "image/png")}
    ok = app.request("POST", path, files=files, data={"model": "vit", "priority": "-1000"})
    assert ok.status_code == 200, ok.text
    refused = app.request("POST", path, files=files, data={"model": "vit", "priority": "1001"})
    assert refused.status_code == 400, refused.text
    assert app.request("POST", path, files=files, data={"model": "vit", "priority": "true"}).status_code == 400
    if path == "/v1/embeddings":
        length = len(ok.json()["data"][0]["embedding"])
        assert app.request("POST", path, files=files,
                           data={"model": "vit", "dimensions": str(length + 1)}).status_code == 400
