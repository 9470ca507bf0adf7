"""`tserve serve --model NAME=file.gguf`: one real server process serving the tiny Llama and Qwen2 from their
safetensors directories and from GGUF F32 files written from them answers /v1/completions and chat the same
for both; a Q8_0 file is served on its own blocks (quantize=auto); a hostile .gguf given on the command line ends
the process with exit code 1 and the reason."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, cycle_prompts
from tests.helpers.gguf_files import header, write_gguf
from tests.helpers.server import ServerProcess, concurrently

FAMILIES = ("llama", "qwen2")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-http")
    models = {}
    for family in FAMILIES:
        d = factories.hf_family_dir(family, root / family)
        models[family] = d
        models[f"{family}-gguf"] = write_gguf(d, root / f"{family}.gguf", family, "F32")
    models["qwen2-q8"] = write_gguf(models["qwen2"], root / "qwen2-q8_0.gguf", "qwen2", "Q8_0")
    srv = ServerProcess(factories.model_flags(models), root / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_file_answers_as_its_safetensors_original(server, family):
    bodies = [{"prompt": t, "max_tokens": 10, "temperature": 0, "logprobs": 1} for t in cycle_prompts(6, seed=5)]
    original = concurrently(server, "/v1/completions", [b | {"model": family} for b in bodies])
    gguf = concurrently(server, "/v1/completions", [b | {"model": f"{family}-gguf"} for b in bodies])
    texts = [a["choices"][0]["text"] for a in original]
    assert [a["choices"][0]["text"] for a in gguf] == texts
    assert [a["choices"][0]["logprobs"]["tokens"] for a in gguf] == [
        a["choices"][0]["logprobs"]["tokens"] for a in original]
    assert_varied(texts, min_distinct=0.8)
    chat = {"messages": [{"role": "user", "content": "Good morning. Where is the station?"}], "max_tokens": 8,
            "temperature": 0}
    answers = [httpx.post(server.url + "/v1/chat/completions", json=chat | {"model": m}, timeout=60).json()
               for m in (family, f"{family}-gguf")]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert answers[0]["usage"] == answers[1]["usage"]


def test_a_q8_0_file_is_served_on_its_own_blocks(server):
    """Without --quantize (auto): as q8_0, the file's blocks as they are, and the log says so."""
    lines = server.log_file.read_text().splitlines()
    records = [json.loads(line[line.index('{"time"'):]) for line in lines if '{"time"' in line]
    served = next(r for r in records if r["message"] == "serving model" and r["model"] == "qwen2-q8")
    assert served["quantization"] == "q8_0"
    said = next(r for r in records if r["message"].startswith("GGUF Q8_0 / Q4_0 blocks served as they are"))
    assert said["gguf_types"]["Q8_0"] > 0 and said["quantization"] == "q8_0" and said["layers_from_blocks"]
    answer = httpx.post(server.url + "/v1/completions", json={"model": "qwen2-q8", "prompt": "The quick brown",
                                                              "max_tokens": 4, "temperature": 0}, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]


def test_a_hostile_gguf_file_ends_the_process(tmp_path):
    (tmp_path / "lying.gguf").write_bytes(header(2**62, 0) + bytes(64))
    srv = ServerProcess(["--model", f"x={tmp_path / 'lying.gguf'}"], tmp_path / "server.log")
    try:
        assert srv.proc.wait(timeout=120) == 1
        last = (tmp_path / "server.log").read_text().strip().splitlines()[-1]
        assert last.startswith("tserve: models failed to load:") and "tensors declared" in last, last
    finally:
        srv.stop()


def test_a_gguf_file_past_max_model_memory_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    from tserve.model import checkpoint
    from tserve.service.errors import APIError
    from tserve.service.metrics import Metrics
    from tserve.service.registry import ModelRegistry
    from tserve.service.settings import Settings

    file = write_gguf(factories.hf_family_dir("qwen2", tmp_path / "qwen2"), tmp_path / "q.gguf", "qwen2", "Q4_0")
    floats = checkpoint.weight_bytes(file, torch.float32)
    reg = ModelRegistry(Settings(max_model_memory=f"{floats - 1}B", warmup=False), Metrics())
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(APIError, match="passes --max-model-memory"):
        reg.load_model("q", file)


def test_gguf_files_of_a_model_repository_load_by_name(tmp_path):
    """`--model-repository DIR`: `NAME.gguf` there loads as NAME (`/v2/repository/models/NAME/load`)."""
    from tserve.service.metrics import Metrics
    from tserve.service.registry import ModelRegistry
    from tserve.service.settings import Settings, checkpoint_dirs

    d = factories.hf_family_dir("qwen2", tmp_path / "repo" / "qwen2")
    write_gguf(d, tmp_path / "repo" / "qwen2-q8.gguf", "qwen2", "Q8_0")
    (tmp_path / "repo" / "notes.txt").write_text("not a model")
    found = checkpoint_dirs(tmp_path / "repo")
    assert found == {"qwen2": d, "qwen2-q8": tmp_path / "repo" / "qwen2-q8.gguf"}
    reg = ModelRegistry(Settings(model_repository=tmp_path / "repo", warmup=False), Metrics())
    reg.load_model("qwen2-q8", found["qwen2-q8"])
    assert reg.models["qwen2-q8"].loaded.quantization == "q8_0"
    reg.stop()
