"""A server of many models at once against one model alone. Most tests serve one model of each kind, or name the
model in every request; a request that names none is routed to "the only model that does it", and what counts as
"it" differs per route: a task (completions, translations, classifications), what an embedding request gives
(text or an image), what an attention request gives (a target to score), a translator for a file. Here one server
holds two language models, a translator whose checkpoint names no languages, and an image classifier: a request
without a model is answered as the same request naming the one model that serves it, and as the same request
on a server of that model alone; where two models serve it, the answer is a 400 that names them, never the first
in the order they were loaded. Every app runs in this process (`httpx.ASGITransport`) on the tiny fixtures."""

from __future__ import annotations

import base64

import pytest

from tests.files.test_option_combinations_files import FileApp
from tests.helpers import factories
from tests.http.test_option_combinations_compat import png

ENGLISH = "the quick brown fox jumps over the lazy dog"
PAGE = "good morning\n\nthe king is here today\n"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("many-models")
    return {"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt"),
            "vit": factories.tiny_vit_dir(root / "vit")}


@pytest.fixture(scope="module")
def many(checkpoints, tmp_path_factory):
    """Two language models (one checkpoint under two names), the translator (no languages in its checkpoint)
    and the image classifier, in one app."""
    app = FileApp(tmp_path_factory.mktemp("many-app"),
                  {"lm": checkpoints["lm"], "lm-copy": checkpoints["lm"], "mt": checkpoints["mt"],
                   "vit": checkpoints["vit"]})
    yield app
    app.stop()


@pytest.fixture(scope="module")
def alone(checkpoints, tmp_path_factory):
    """The translator alone, and the classifier alone: what a request without a model gets there is the answer."""
    apps = {name: FileApp(tmp_path_factory.mktemp(f"alone-{name}"), {name: checkpoints[name]})
            for name in ("mt", "vit")}
    yield apps
    for app in apps.values():
        app.stop()


def without_ids(body: dict) -> dict:
    """A response without what differs between two answers to one request (its id, its creation time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


# ------------------------------------------------------------------------------------------------------------
# Two models of one task: the request must say which
# ------------------------------------------------------------------------------------------------------------
def test_completions_without_a_model_are_refused_when_two_language_models_are_served(many):
    """Two language models serve completions: a request without 'model' is a 400 naming both (whichever was
    loaded first is not a default), on /v1/completions and /v1/chat/completions; naming one answers."""
    for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                 "temperature": 0})):
        error = many.post(path, body, 400).json()["error"]
        assert error["code"] == "model_required", error
        assert "lm" in error["message"] and "lm-copy" in error["message"], error
        assert many.post(path, {**body, "model": "lm-copy"}).json()["model"] == "lm-copy"


def test_text_embeddings_without_a_model_are_refused_when_several_models_embed_text(many):
    """Both language models and the translator embed text: an embedding of text without 'model' is a 400 that
    names the text embedders (and not the image model)."""
    error = many.post("/v1/embeddings", {"input": ENGLISH}, 400).json()["error"]
    assert error["code"] == "model_required", error
    assert "lm, lm-copy, mt" in error["message"] and "vit" not in error["message"], error


# ------------------------------------------------------------------------------------------------------------
# One model of the kind a request needs, beside models of other kinds: it is the default
# ------------------------------------------------------------------------------------------------------------
def test_an_image_embedding_without_a_model_is_the_image_models_beside_text_models(many, alone):
    """An image given to /v1/embeddings without 'model' goes to the one model that embeds images, however many
    models embed text beside it: the vector of the request naming it, and of the classifier served alone."""
    body = {"image": base64.b64encode(png(3)).decode()}
    unnamed = many.post("/v1/embeddings", body).json()
    assert unnamed["model"] == "vit"
    assert unnamed["data"] == many.post("/v1/embeddings", {**body, "model": "vit"}).json()["data"]
    assert unnamed["data"] == alone["vit"].post("/v1/embeddings", body).json()["data"]
    classified = many.post("/v1/classifications", body).json()
    assert classified == alone["vit"].post("/v1/classifications", body).json()


def test_a_translation_without_a_model_is_the_only_translators_beside_language_models(many, alone):
    """The one translator (its checkpoint names no languages, so no pair routes to it) answers /v1/translations
    without 'model' beside two language models as it does alone: same text, same usage, no route named."""
    body = {"input": [ENGLISH, "good morning"], "num_beams": 1, "max_tokens": 12}
    unnamed = many.post("/v1/translations", body).json()
    assert unnamed["model"] == "mt" and "models" not in unnamed, unnamed
    assert without_ids(unnamed) == without_ids(alone["mt"].post("/v1/translations", body).json())


def test_a_file_without_a_model_is_translated_by_the_only_translator_beside_language_models(many, alone):
    """A file job without 'model' on a server of several models, one of them a translator, is that translator's
    job: it succeeds and writes the file the translator alone writes (not a route looked for among language
    pairs that no served model names)."""
    data = PAGE.encode()
    state, written = many.job("page.txt", data, num_beams="1")
    alone_state, alone_written = alone["mt"].job("page.txt", data, num_beams="1")
    assert written == alone_written and written.strip()
    assert state["models"] == alone_state["models"] == ["mt"], state


def test_attention_of_a_target_without_a_model_is_the_translators_beside_language_models(many, alone):
    """/v1/attention with a 'target' to score and no 'model' goes to the one model that scores targets (the
    translator): language models beside it read text too but score no target, so they are no candidates."""
    body = {"input": "good morning", "target": "guten Morgen", "layers": [0], "heads": [0]}
    unnamed = many.post("/v1/attention", body).json()
    assert unnamed == many.post("/v1/attention", {**body, "model": "mt"}).json()
    assert unnamed == alone["mt"].post("/v1/attention", body).json()
