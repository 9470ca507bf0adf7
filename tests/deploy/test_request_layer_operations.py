"""Operations between the client and the engines, beside a non-default configuration: the model repository API
with a dotted model name, an invalid name and a name unloaded twice; the repository API and every worker while
the server drains; /readyz's model list beside a model loaded at run time; which model answers a request that
names none when no model of its task is served; a text of exactly a model's length (embeddings) and the logit
lens's last layer; `source_lang` sent to a model that takes none; a task module that serves a built-in task;
and `--model` entries without a name or a path. Every app runs in this process (`httpx.ASGITransport`) on the
tiny fixture models, so that each test takes seconds."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from tests.helpers.in_process import InProcessApp
from tests.http.test_option_combinations_compat import png
from tserve.model import logit_lens as lens
from tserve.service import tasks
from tserve.service.engine.request import QueueFull
from tserve.service.generation.served import ServedLanguageModel
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.settings import Settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY_LM, TINY_MT = FIXTURES / "tiny-lm", FIXTURES / "tiny-mt"
QUIET = {"warmup": False, "gc_freeze": False, "device": "cpu"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A language model named "tiny" and a translator named "mt", given in that order (not sorted), with a model
    repository that holds the language model under a dotted name, and loads from a request's path allowed."""
    repository = tmp_path_factory.mktemp("operations-repository")
    (repository / "lm.v2").symlink_to(TINY_LM, target_is_directory=True)
    served = InProcessApp({"tiny": TINY_LM, "mt": TINY_MT}, model_repository=str(repository),
                          allow_load_paths=True, warmup=False, gc_freeze=False)
    yield served
    served.stop()


def index(app: InProcessApp) -> dict[str, str]:
    return {m["name"]: m["state"] for m in app.post("/v2/repository/index", {}).json()}


# ------------------------------------------------------------------------------------------------------------
# The model repository API: names
# ------------------------------------------------------------------------------------------------------------
def test_a_dotted_name_loads_serves_and_unloads_and_a_second_unload_is_a_404(app):
    """A model name may hold '.', as the route's own message says ("letters, digits, '-', '_' and '.'"): a model
    versioned in its name loads from the repository, answers, shows in /readyz's sorted list beside the start-up
    models, and unloads. Unloading it again, or a repository model never loaded, is a 404 that names the loaded
    models, never a 500: the name is known (UNAVAILABLE) but nothing serves under it."""
    assert app.post("/v2/repository/models/lm.v2/load", {}).json() == {"name": "lm.v2", "state": "READY"}
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    texts = [app.post("/v1/completions", body | {"model": m}).json()["choices"][0]["text"] for m in ("tiny", "lm.v2")]
    assert texts[0] == texts[1]
    ready = app.request("GET", "/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "models": ["lm.v2", "mt", "tiny"]}

    assert app.post("/v2/repository/models/lm.v2/unload", {}).json() == {"name": "lm.v2", "state": "UNAVAILABLE"}
    assert index(app)["lm.v2"] == "UNAVAILABLE"
    again = app.post("/v2/repository/models/lm.v2/unload", {}, status=404).json()
    assert "not loaded" in again["error"]
    app.post("/v2/repository/models/never/unload", {}, status=404)
    assert app.request("GET", "/readyz").json()["models"] == ["mt", "tiny"]


def test_an_invalid_model_name_is_refused_before_it_is_claimed(app):
    """A load under a name that is not letters, digits, '-', '_' and '.' is a 400, and the name is never claimed:
    the index does not show it LOADING, and the same name's load stays a 400 (not a 409 "busy"). Without a path
    the name is refused for what it is too, not looked up in the repository (a 404 "not in the repository")."""
    for body in ({"parameters": {"path": str(TINY_LM)}},) * 2 + ({},):
        refused = app.post("/v2/repository/models/bad%20name/load", body, status=400).json()
        assert "a model name is" in refused["error"]
    assert "bad name" not in index(app)
    assert "bad name" not in app.registry.models and "bad name" not in app.registry.states


# ------------------------------------------------------------------------------------------------------------
# Draining
# ------------------------------------------------------------------------------------------------------------
def test_while_draining_the_repository_api_is_503_and_every_worker_refuses_new_work():
    """Once the drain begins (a SIGTERM), the repository API answers 503 as the inference routes do: no model is
    loaded into a server that is shutting down. Every worker of every model refuses new work, the embeddings
    batcher beside a model's main worker included (a request that passed the readiness gate just before the drain
    must not be queued behind it)."""
    drained = InProcessApp({"tiny": TINY_LM, "mt": TINY_MT}, allow_load_paths=True, warmup=False, gc_freeze=False)
    try:
        drained.registry.begin_drain()
        assert drained.request("GET", "/readyz").status_code == 503
        drained.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}, status=503)
        drained.post("/v2/repository/index", {}, status=503)
        drained.post("/v2/repository/models/again/load", {"parameters": {"path": str(TINY_LM)}}, status=503)
        assert "again" not in drained.registry.models and "again" not in drained.registry.states

        async def enqueue(batcher) -> None:  # noqa: ANN001 - a DynamicBatcher; on an event loop, as routes call it
            batcher.enqueue([[5, 6, 7]])

        for served in drained.registry.models.values():
            assert served.embedder is not None
            with pytest.raises(QueueFull, match="shutting down"):
                asyncio.run(enqueue(served.embedder))
    finally:
        drained.stop()


def test_a_request_that_meets_a_worker_already_refusing_is_a_503_not_a_429():
    """A request that passed the readiness gate a moment before the drain began (or before its model's unload or
    replacement) meets a worker that takes no new work: it gets what the gate gives a moment later, 503 with
    Retry-After (the server is going away, retrying here soon will not help), not a 429 that says "too many
    requests" to a client that sent one. Completions, chat, and embeddings (the batcher beside the worker)."""
    racing = InProcessApp({"tiny": TINY_LM}, warmup=False, gc_freeze=False)
    try:
        for worker in racing.registry.models["tiny"].workers:
            worker.refuse_new()  # the workers' half of a drain, without the gate's
        assert racing.request("GET", "/readyz").status_code == 200
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
                           ("/v1/embeddings", {"input": "the quick brown fox"})):
            resp = racing.post(path, {"model": "tiny"} | body, status=503)
            assert resp.headers["Retry-After"] and "shutting down" in resp.json()["error"]["message"], resp.text
    finally:
        racing.stop()


# ------------------------------------------------------------------------------------------------------------
# Which model answers
# ------------------------------------------------------------------------------------------------------------
def test_a_request_without_a_model_for_a_task_no_model_serves_is_a_404(app):
    """/v1/classifications without a model on a server of a language model and a translator: no model does
    classification, which is a 404 model_not_found (as a named model that does not exist), not a 400."""
    image = base64.b64encode(png(0)).decode()
    error = app.post("/v1/classifications", {"image": image}, status=404).json()["error"]
    assert error["code"] == "model_not_found" and "classification" in error["message"]


def test_source_lang_is_refused_by_a_language_models_embeddings(app):
    """`source_lang` names a multilingual translator's input language; a language model takes none, and a
    request that sends one is a 400 naming it rather than an embedding that silently ignored it."""
    text = "the quick brown fox"
    app.post("/v1/embeddings", {"model": "tiny", "input": text})
    error = app.post("/v1/embeddings", {"model": "tiny", "input": text, "source_lang": "de"}, status=400).json()
    assert "source_lang" in error["error"]["message"]


# ------------------------------------------------------------------------------------------------------------
# Limits at their exact edge
# ------------------------------------------------------------------------------------------------------------
def _text_of(tokenizer, n: int) -> str:  # noqa: ANN001 - a Tokenizer
    """A text that encodes to exactly `n` tokens."""
    for word in ("a", "the", "x", "good", "one"):
        for k in range(n // 4, 2 * n):
            text = " ".join([word] * k)
            if len(tokenizer.encode(text)) == n:
                return text
    raise AssertionError(f"no text of {n} tokens found")


def test_embeddings_take_a_text_of_exactly_the_models_length_and_refuse_one_token_more(app):
    """The tiny language model's context is 128 tokens: a text of exactly 128 tokens embeds, 129 is a 400 naming
    the limit."""
    loaded = app.registry.models["tiny"].loaded
    limit = loaded.config.max_seq_len
    exact, over = _text_of(loaded.tokenizer, limit), _text_of(loaded.tokenizer, limit + 1)
    vectors = app.post("/v1/embeddings", {"model": "tiny", "input": exact}).json()["data"]
    assert len(vectors) == 1 and len(vectors[0]["embedding"]) == loaded.config.d_model
    error = app.post("/v1/embeddings", {"model": "tiny", "input": over}, status=400).json()["error"]
    assert f"takes at most {limit}" in error["message"]


def test_the_logit_lens_takes_its_last_layer_and_refuses_the_one_past_it(app):
    """Lens layers run from 0 (the embedding output) to the number of blocks: the last one is answered, the
    one past it is a 400 naming the range (never a 500 or an answer of another layer)."""
    count = lens.n_layers(app.registry.models["tiny"].loaded)
    body = {"model": "tiny", "input": "the quick brown fox", "top_k": 1}
    last = app.post("/v1/logit_lens", body | {"layers": [count - 1]}).json()
    assert [layer["layer"] for layer in last["layers"]] == [count - 1]
    error = app.post("/v1/logit_lens", body | {"layers": [count]}, status=400).json()["error"]
    assert f"numbered 0 to {count - 1}" in error["message"]


# ------------------------------------------------------------------------------------------------------------
# Task modules and --model entries
# ------------------------------------------------------------------------------------------------------------
def test_a_task_module_that_registers_a_built_in_task_serves_it(monkeypatch):
    """`register` serves a task's checkpoints with the class given, a built-in task included: a task module may
    replace the text generation class (e.g. to add card fields), and a model loaded afterwards is built from it."""

    class Custom(ServedLanguageModel):
        def card_fields(self):  # noqa: ANN202
            return super().card_fields() | {"owned_by": "custom"}

    monkeypatch.setattr(tasks, "SERVED", dict(tasks.SERVED))
    tasks.register(Custom)
    assert tasks.served_class(ServedLanguageModel.task) is Custom
    reg = ModelRegistry(Settings(**QUIET), Metrics())
    reg.load_model("lm", TINY_LM)
    try:
        assert type(reg.models["lm"]) is Custom and reg.models["lm"].card_fields()["owned_by"] == "custom"
    finally:
        reg.stop()


@pytest.mark.parametrize("entry", ["=/srv/lm", "lm=", "lm"])
def test_a_model_entry_without_a_name_or_a_path_is_refused_from_flags_and_from_the_environment(entry, monkeypatch):
    """NAME=PATH needs both parts: an entry without a name (which would serve a model named "") or without a
    path (which would load the working directory) is refused when the settings are read, from `--model` as from
    TSERVE_MODELS."""
    with pytest.raises(ValueError, match="NAME=PATH"):
        Settings(models=[entry]).model_specs()
    monkeypatch.setenv("TSERVE_MODELS", f"ok=/srv/ok,{entry}")
    with pytest.raises(ValueError, match="NAME=PATH"):
        Settings().model_specs()
