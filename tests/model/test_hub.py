"""Hugging Face repo ids as checkpoints (`model.hub`), without the internet: a hub cache laid out by hand
(offline), a local HTTP server that answers as the hub does (HF_ENDPOINT), and a real server process serving
`--model qwen=org/tiny-qwen2` from the cache."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest
from huggingface_hub import constants

from tests.helpers import factories
from tests.helpers.server import ServerProcess
from tserve.model import checkpoint, hub
from tserve.model.checkpoint import CheckpointError

MAIN = "a" * 40
V1 = "b" * 40
# Files the repo lists that are never fetched: one only ALLOW_PATTERNS keeps out, one only IGNORE_PATTERNS.
DECOYS = {"model.onnx": b"onnx weights", "pytorch_model.bin": b"pickled weights", "tokenizer.bin": b"pickles"}


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """A fresh HF_HOME, no token, online, and an endpoint where nothing listens. huggingface_hub reads these
    variables into `huggingface_hub.constants` at import, so the module is read again (and once more after
    the test, with the variables restored)."""
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "HF_OIDC_RESOURCE", "HUGGINGFACE_CO_STAGING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))

    def configure(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        importlib.reload(constants)

    configure(HF_ENDPOINT=_closed_port_url())
    yield configure
    monkeypatch.undo()
    importlib.reload(constants)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    return factories.hf_family_dir("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")


def lay_out_cache(cache: Path, repo_id: str, files: Path, refs: dict[str, str]) -> dict[str, Path]:
    """The hub cache's layout, as snapshot_download leaves it: refs/<ref> holds a commit hash, snapshots/<hash>/
    the files (there links into blobs/; plain copies do as well). One snapshot per ref; ref -> snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshots = {}
    for ref, commit in refs.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshots[ref] = shutil.copytree(files, repo / "snapshots" / commit)
    return snapshots


# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["org/name", "Qwen/Qwen2.5-0.5B-Instruct@main", "a.b/c_d-1@v1.0",
                                   "org/name@refs/pr/1", "org/name@" + MAIN])
def test_repo_ids(value):
    assert hub.is_repo_id(value)


@pytest.mark.parametrize("value", ["name", "/abs/dir", "./org/name", "org/name/sub", "-org/name", "org/.name",
                                   "org/name@", "org /name", "~/models/x"])
def test_not_repo_ids(value):
    assert not hub.is_repo_id(value)


# ------------------------------------------------------------------------------------------------------------
def test_offline_resolves_from_the_cache(hf_env, tiny_qwen2, tmp_path):
    hf_env(HF_HUB_OFFLINE="1")
    snapshots = lay_out_cache(tmp_path / "hf-home" / "hub", "org/tiny-qwen2", tiny_qwen2, {"main": MAIN, "v1": V1})
    path = hub.resolve("org/tiny-qwen2")
    assert path == snapshots["main"]
    assert checkpoint.load(path).task == "text-generation"
    assert hub.resolve("org/tiny-qwen2@v1") == snapshots["v1"]
    assert hub.resolve(f"org/tiny-qwen2@{V1}") == snapshots["v1"]


def test_offline_without_the_repo_in_the_cache_is_a_clear_error(hf_env, tiny_qwen2, tmp_path):
    hf_env(HF_HUB_OFFLINE="1")
    lay_out_cache(tmp_path / "hf-home" / "hub", "org/tiny-qwen2", tiny_qwen2, {"main": MAIN})
    for value in ("org/elsewhere", "org/tiny-qwen2@v2"):
        with pytest.raises(CheckpointError) as info:
            hub.resolve(value)
        message = str(info.value)
        assert value.split("@")[0] in message and "not in the Hugging Face cache" in message
        assert str(tmp_path / "hf-home" / "hub") in message and "HF_HUB_OFFLINE=1" in message


def test_a_local_directory_wins_over_a_repo_id(hf_env, tiny_qwen2, tmp_path, monkeypatch):
    hf_env(HF_HUB_OFFLINE="1")  # with nothing in the cache: any hub lookup fails
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_qwen2, tmp_path / "org" / "tiny-qwen2")
    assert hub.checkpoint_dir(Path("org/tiny-qwen2")) == Path("org/tiny-qwen2")
    assert hub.checkpoint_dir(Path("no/such-dir-here/x")) == Path("no/such-dir-here/x")  # for load to report
    with pytest.raises(CheckpointError, match="offline"):
        hub.checkpoint_dir(Path("org/other"))


def test_an_unreachable_hub_is_a_clear_error(hf_env):
    with pytest.raises(CheckpointError) as info:
        hub.resolve("org/tiny-qwen2")
    assert "org/tiny-qwen2" in str(info.value) and "could not be reached" in str(info.value)


# ------------------------------------------------------------------------------------------------------------
class FakeHub:
    """A local HTTP server answering the requests snapshot_download makes: model info (with `siblings`), the
    file tree at a commit, and HEAD / GET of /{repo}/resolve/{revision}/{file}. It records every request."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str] = frozenset()) -> None:
        self.repos, self.gated = repos, gated
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                fake.answer(self, body=False)

            def do_GET(self) -> None:
                fake.answer(self, body=True)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path, {k.lower(): v for k, v in handler.headers.items()}))
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo_id = "/".join(parts[2:4] if api else parts[:2])
        rest = parts[4:] if api else parts[2:]
        if repo_id not in self.repos:
            return self.send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        if repo_id in self.gated:
            message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
            return self.send(handler, 401, json.dumps({"error": message}).encode(),
                             {"X-Error-Code": "GatedRepo", "X-Error-Message": message})
        files = self.repos[repo_id]
        if rest[:1] in (["revision"], ["tree"], ["resolve"]) and rest[1] not in ("main", MAIN):
            return self.send(handler, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
        commit = {"X-Repo-Commit": MAIN}
        if rest[:1] == ["revision"]:
            info = {"id": repo_id, "sha": MAIN, "siblings": [{"rfilename": name} for name in files]}
            return self.send(handler, 200, json.dumps(info).encode(), commit)
        if rest[:1] == ["tree"]:
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in files.items()]
            return self.send(handler, 200, json.dumps(tree).encode(), commit)
        if rest[:1] == ["resolve"] and "/".join(rest[2:]) in files:
            data = files["/".join(rest[2:])]
            return self.send(handler, 200, data, {**commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, body)
        return self.send(handler, 404, b'{"error": "Entry not found"}', {**commit, "X-Error-Code": "EntryNotFound"})

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str],
             body: bool = True) -> None:
        handler.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers, "Content-Length": str(len(data))}.items():
            handler.send_header(name, value)
        handler.end_headers()
        if body and handler.command != "HEAD":
            handler.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(hf_env, tiny_qwen2):
    files = {p.name: p.read_bytes() for p in tiny_qwen2.iterdir()} | DECOYS
    fake = FakeHub({"org/tiny-qwen2": files, "org/gated": files}, gated={"org/gated"})
    hf_env(HF_ENDPOINT=fake.url)
    yield fake
    fake.close()


def test_download_fetches_safetensors_json_and_tokenizer_files_only(fake_hub, tiny_qwen2, caplog, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    caplog.set_level(logging.INFO, logger="tserve.model.hub")
    path = hub.resolve("org/tiny-qwen2@main")
    assert path == Path(constants.HF_HUB_CACHE) / "models--org--tiny-qwen2" / "snapshots" / MAIN
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in tiny_qwen2.iterdir())
    assert checkpoint.load(path).task == "text-generation"

    downloads = [p for p in fake_hub.paths() if "/resolve/" in p]
    assert downloads and not [p for p in downloads if p.endswith(tuple(DECOYS))], downloads
    assert {h.get("authorization") for _, _, h in fake_hub.requests} == {"Bearer hf_test_token"}

    start, end = (next(r for r in caplog.records if r.getMessage() == m) for m in ("downloading model",
                                                                                  "model downloaded"))
    assert (start.repo, start.revision) == ("org/tiny-qwen2", "main")
    files = list(tiny_qwen2.iterdir())
    assert (end.path, end.files, end.bytes) == (str(path), len(files), sum(p.stat().st_size for p in files))
    assert end.seconds >= 0


def test_an_unknown_repo_is_a_clear_error(fake_hub):
    with pytest.raises(CheckpointError) as info:
        hub.resolve("org/missing")
    message = str(info.value)
    assert "org/missing" in message and "not found or is private" in message and "HF_TOKEN" in message


def test_a_gated_repo_is_a_clear_error(fake_hub):
    with pytest.raises(CheckpointError) as info:
        hub.resolve("org/gated")
    message = str(info.value)
    assert "org/gated" in message and "gated" in message and "licence" in message and "HF_TOKEN" in message


def test_an_unknown_revision_is_a_clear_error(fake_hub):
    with pytest.raises(CheckpointError) as info:
        hub.resolve("org/tiny-qwen2@nope")
    assert "org/tiny-qwen2" in str(info.value) and "revision 'nope' not found" in str(info.value)


# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # 5 s: a server of its own for the repo id resolved by the tests above
def test_the_server_serves_a_repo_id_from_the_cache(tiny_qwen2, tmp_path):
    hf_home = tmp_path / "hf-home"
    lay_out_cache(hf_home / "hub", "org/tiny-qwen2", tiny_qwen2, {"main": MAIN})
    env = {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": _closed_port_url()}
    srv = ServerProcess(["--model", "qwen=org/tiny-qwen2"], tmp_path / "server.log",
                        env=env).wait_ready()
    try:
        models = httpx.get(srv.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["qwen"]
        resp = httpx.post(srv.url + "/v1/completions", json={"model": "qwen", "prompt": "Hello", "max_tokens": 4},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
        assert '"message": "model downloaded"' in srv.log()
    finally:
        srv.stop()
