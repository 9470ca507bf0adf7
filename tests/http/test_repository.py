"""The model repository API of a real `tserve serve`: the index and its states, loading from --model-repository
beside serving, replacing a model under its name while requests run (each sees the old one or the new one), a
failed load that leaves the process up, unloading (new requests 503 at once, the running one finishes, the memory
given back: the process's RSS), admin keys, and `tserve models`."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref

import httpx
import pytest
import torch

from tests.helpers import factories
from tests.helpers.server import ServerProcess, rss_kib

ADMIN, USER = "adm-0123456789", "usr-0123456789"
A = {"Authorization": f"Bearer {ADMIN}"}
U = {"Authorization": f"Bearer {USER}"}


def rss_mb(pid: int) -> float:
    return rss_kib(pid) / 1024


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("repository")
    repo = root / "repo"
    factories.tiny_mt_dir(repo / "mt", languages=("en", "de"))
    factories.tiny_lm_dir(repo / "big", trained=False, d_model=384, n_heads=6, d_ff=1536, n_layers=8)  # ~57 MB
    broken = repo / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architecture": "decoder", "d_model": 64}))
    lm = factories.tiny_lm_dir(root / "lm")
    srv = ServerProcess(["--model", f"lm={lm}", "--model-repository", str(repo), "--allow-load-paths"],
                        root / "server.log", env={"TSERVE_API_KEYS": USER, "TSERVE_ADMIN_KEYS": ADMIN}).wait_ready()
    yield srv, lm
    srv.stop()


def post(srv, path: str, body: dict | None = None, headers: dict | None = None, status: int = 200):
    resp = httpx.post(srv.url + path, json=body or {}, headers=A if headers is None else headers, timeout=300)
    assert resp.status_code == status, resp.text
    return resp.json()


def states(srv) -> dict[str, str]:
    return {m["name"]: m["state"] for m in post(srv, "/v2/repository/index")}


def complete(srv, model: str = "lm", status: int = 200) -> dict:
    return post(srv, "/v1/completions", {"model": model, "prompt": "Good morning", "max_tokens": 4,
                                         "temperature": 0}, U, status)


def test_index_admin_keys_and_loading_by_name(setup):
    srv, _ = setup
    assert states(srv) == {"lm": "READY", "mt": "UNAVAILABLE", "big": "UNAVAILABLE", "broken": "UNAVAILABLE"}
    assert post(srv, "/v2/repository/index", headers=U, status=401) == {
        "error": "the model repository API needs an admin key (TSERVE_ADMIN_KEYS)"}
    post(srv, "/v2/repository/index", headers={}, status=401)
    post(srv, "/v1/completions", {"model": "lm", "prompt": "x"}, A, 401)  # an admin key is not an API key

    assert post(srv, "/v2/repository/models/mt/load") == {"name": "mt", "state": "READY"}
    assert states(srv)["mt"] == "READY"
    translated = post(srv, "/v1/translations", {"model": "mt", "input": "the quick brown fox"}, U)
    assert translated["data"][0]["translation"]
    libre = post(srv, "/translate", {"q": "good morning", "source": "en", "target": "de", "api_key": USER}, {})
    assert libre["translatedText"]  # the new model's pair is routed too

    failed = post(srv, "/v2/repository/models/broken/load", status=400)["error"]
    assert "failed to load" in failed
    entry = next(m for m in post(srv, "/v2/repository/index") if m["name"] == "broken")
    assert entry["state"] == "UNAVAILABLE" and entry["reason"]
    assert complete(srv)["choices"][0]["text"] is not None  # the process serves on
    post(srv, "/v2/repository/models/nothing/load", status=404)
    assert post(srv, "/v2/repository/index", {"ready": True}) == [
        {"name": n, "version": "1", "state": "READY", "reason": ""} for n in ("lm", "mt")]


def test_replacing_a_model_while_requests_run(setup, tmp_path):
    """Requests sent all through a replacement: every one answered (by the old model or the new one)."""
    srv, lm = setup
    other = factories.tiny_lm_dir(tmp_path / "lm2", trained=False)
    stop, answers = threading.Event(), []

    def keep_asking() -> None:
        while not stop.is_set():
            r = httpx.post(srv.url + "/v1/completions", json={"model": "lm", "prompt": "Good morning",
                                                              "max_tokens": 4, "temperature": 0}, headers=U)
            answers.append((r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

    before = complete(srv)["choices"][0]["text"]
    askers = [threading.Thread(target=keep_asking) for _ in range(3)]
    for t in askers:
        t.start()
    post(srv, "/v2/repository/models/lm/load", {"parameters": {"path": str(other)}})
    time.sleep(0.3)
    stop.set()
    for t in askers:
        t.join()
    after = complete(srv)["choices"][0]["text"]
    assert after != before  # the random model answers now
    assert answers and all(status == 200 for status, _ in answers), answers[:5]
    assert {text for _, text in answers} <= {before, after}
    post(srv, "/v2/repository/models/lm/load", {"parameters": {"path": str(lm)}})  # back, for the other tests
    assert complete(srv)["choices"][0]["text"] == before


def test_unloading_drains_refuses_and_gives_the_memory_back(setup):
    srv, _ = setup
    base = rss_mb(srv.proc.pid)
    post(srv, "/v2/repository/models/big/load")
    loaded = rss_mb(srv.proc.pid)
    assert loaded - base > 40  # the weights (about 57 MB)

    async def go() -> tuple[list[str], int, int]:
        async with httpx.AsyncClient(timeout=300) as c:
            chunks: list[str] = []

            async def stream() -> None:
                body = {"model": "big", "prompt": "Good", "max_tokens": 100, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
                async with c.stream("POST", srv.url + "/v1/completions", json=body, headers=U) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            chunks.append(line)

            running = asyncio.create_task(stream())
            while len(chunks) < 2:
                await asyncio.sleep(0.01)
            unloading = asyncio.create_task(c.post(srv.url + "/v2/repository/models/big/unload", headers=A))
            await asyncio.sleep(0.2)
            refused = (await c.post(srv.url + "/v1/completions", headers=U,
                                    json={"model": "big", "prompt": "x", "max_tokens": 2})).status_code
            await running
            return chunks, refused, (await unloading).status_code

    chunks, refused, unloaded = asyncio.run(go())
    assert refused in (503, 404) and unloaded == 200
    # The running stream finished: all 100 tokens (a chunk may carry several: bytes of one character wait for
    # the rest of it), then the usage chunk and [DONE].
    assert chunks[-1] == "data: [DONE]" and json.loads(chunks[-2][6:])["usage"]["completion_tokens"] == 100
    assert states(srv)["big"] == "UNAVAILABLE"
    complete(srv, "big", 404)
    # The model's objects are freed (test below); how much of their memory the allocator hands back varies.
    assert rss_mb(srv.proc.pid) < loaded - 12


def test_the_models_command(setup, monkeypatch, capsys):
    """`tserve models`, its `main` in this process: a new interpreter's imports cost seconds (test_package.py
    starts `python -m tserve` once)."""
    from tserve.service.cli import main

    srv, _ = setup
    monkeypatch.setenv("TSERVE_URL", srv.url)
    monkeypatch.setenv("TSERVE_ADMIN_KEY", ADMIN)
    assert main(["models", "list"]) == 0 and "lm\tREADY" in capsys.readouterr().out
    assert main(["models", "unload", "lm", "--key", "wrong"]) == 1 and "401" in capsys.readouterr().err


def test_a_load_past_max_model_memory_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    from tserve.model import checkpoint
    from tserve.service.errors import APIError
    from tserve.service.metrics import Metrics
    from tserve.service.registry import ModelRegistry
    from tserve.service.settings import Settings

    d = factories.tiny_lm_dir(tmp_path / "lm", trained=False, d_model=128, n_heads=4, d_ff=256, n_layers=2)
    loaded = checkpoint.load(d)
    distinct = {t.data_ptr(): t for t in loaded.model.state_dict().values()}  # a tied head is the embedding
    stored = sum(t.numel() * t.element_size() for t in distinct.values() if t.is_floating_point())
    assert checkpoint.weight_bytes(d, torch.float32) == stored
    assert checkpoint.weight_bytes(d, torch.bfloat16) == stored // 2

    reg = ModelRegistry(Settings(max_model_memory=f"{stored - 1}B", warmup=False), Metrics())
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(APIError, match="passes --max-model-memory"):
        reg.load_model("lm", d)
    assert reg.states["lm"].state == "UNAVAILABLE" and "max-model-memory" in reg.states["lm"].reason
    monkeypatch.undo()
    roomy = ModelRegistry(Settings(max_model_memory=f"{stored * 2 - 1}B", warmup=False), Metrics())
    roomy.load_model("lm", d)
    model = weakref.ref(roomy.models["lm"].loaded.model)
    roomy.unload_model("lm")
    assert model() is None  # nothing holds the unloaded model: its memory is free
    roomy.load_model("lm", d)
    with pytest.raises(APIError, match="passes --max-model-memory"):  # two of it do not fit
        roomy.load_model("lm2", d)
