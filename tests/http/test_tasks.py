"""A task is one module: a test-only fourth task (`feature_extraction_task.py`, text embeddings) is served
beside the built-in ones through `--task-modules` alone, over every route that is not a task's own API
(/v1/models, /v1/attention, the Open Inference Protocol, readiness, metrics); and the service's model work
(attention maps) is bounded before the model runs."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.helpers import factories
from tests.helpers.feature_extraction_task import embed
from tests.helpers.server import ServerProcess
from tserve.model import attention_maps as am
from tserve.model.checkpoint import load
from tserve.service.errors import InvalidInput
from tserve.service.metrics import Metrics
from tserve.service.schemas import AttentionRequest
from tserve.service.settings import Settings
from tserve.service.tasks import ServedLanguageModel


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    d = factories.tiny_lm_dir(tmp_path_factory.mktemp("emb") / "emb")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "task": "feature-extraction"}))
    return d


@pytest.fixture(scope="module")
def served(embedder_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    lm = factories.tiny_lm_dir(root / "lm")
    srv = ServerProcess(["--model", f"lm={lm}", "--model", f"emb={embedder_dir}",
                         "--task-modules", "tests.helpers.feature_extraction_task"], root / "server.log").wait_ready()
    yield srv
    srv.stop()


def test_a_fourth_task_module_is_served_with_no_edits_elsewhere(served, embedder_dir):
    ref = load(embedder_dir)
    assert ref.task == "feature-extraction"
    models = httpx.get(f"{served.url}/v1/models").json()["data"]
    assert {m["id"]: m["task"] for m in models} == {"lm": "text-generation", "emb": "feature-extraction"}

    meta = httpx.get(f"{served.url}/v2/models/emb").json()
    assert meta["inputs"][0]["name"] == "text" and meta["outputs"][0]["shape"] == [-1, ref.config.d_model]
    assert httpx.get(f"{served.url}/v2/models/emb/ready").status_code == 200

    texts = ["Hello world", "Hello there, world"]
    before = served.metric("tserve_model_calls_total", "emb", 0)
    resp = httpx.post(f"{served.url}/v2/models/emb/infer", json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}]}, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()["outputs"][0]
    assert out["shape"] == [2, ref.config.d_model]
    got = torch.tensor(out["data"]).reshape(2, -1)
    torch.testing.assert_close(got, torch.tensor(embed(ref, texts)), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got[0], got[1])  # the embedding depends on the input

    attention = httpx.post(f"{served.url}/v1/attention", json={"model": "emb", "input": "Hello world",
                                                               "layers": [1], "heads": [0, 2]}, timeout=60).json()
    expected = am.lm_attention(ref, "Hello world", layers=[1], heads=[0, 2])
    torch.testing.assert_close(torch.tensor(attention["maps"][0]["weights"]), expected[0].weights)
    assert served.metric("tserve_model_calls_total", "emb") == before + 1  # a call job of its batcher

    wrong = httpx.post(f"{served.url}/v1/completions", json={"model": "emb", "prompt": "Hello"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_task"
    empty = httpx.post(f"{served.url}/v2/models/emb/infer", json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": [""]}]})
    assert empty.status_code == 400 and "non-empty" in empty.json()["error"]


def test_a_checkpoint_whose_task_no_module_serves_is_a_clear_load_error(embedder_dir, tmp_path):
    """A model given on the command line that fails to load ends the process: exit code 1, the error on stderr's
    last line (a supervisor sees it, as with vLLM and TGI), not a server answering 503 for ever."""
    srv = ServerProcess(["--model", f"emb={embedder_dir}"], tmp_path / "server.log")
    try:
        assert srv.proc.wait(timeout=120) == 1
        last = (tmp_path / "server.log").read_text().strip().splitlines()[-1]
        assert last.startswith("tserve: models failed to load:")
        assert "no task module serves 'feature-extraction'" in last and "--task-modules" in last
    finally:
        srv.stop()


def test_attention_weights_are_bounded_before_the_model_runs(tiny_lm, monkeypatch):
    loaded = load(tiny_lm)
    served = ServedLanguageModel("lm", loaded, Settings(max_attention_floats=100), Metrics())

    def no_model_work(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("the model ran before the limit was checked")

    monkeypatch.setattr(loaded.model, "forward_with_attention", no_model_work)
    with pytest.raises(InvalidInput, match="the limit is 100") as info:
        served.attention_maps(AttentionRequest(model="lm", input="Hello world, good morning"), None)
    assert info.value.code == "too_many_weights"
