"""GGUF files of Hugging Face repos (`--model NAME=ORG/REPO[@REVISION]:FILE.gguf` or `:QUANT`, as llama.cpp's
`-hf` takes them), resolved without the internet: from a hub cache laid out by hand (offline), and from a local
server that answers as the hub does, which must be asked for the one file named and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.gguf_files import write_gguf
from tests.model import test_hub
from tests.model.test_hub import MAIN, FakeHub, lay_out_cache
from tserve.model import checkpoint, hub
from tserve.model.checkpoint import CheckpointError

hf_env, tiny_qwen2 = test_hub.hf_env, test_hub.tiny_qwen2  # the hub tests' fixtures: a fresh HF_HOME, a tiny Qwen2


@pytest.fixture(scope="module")
def gguf_repo(tiny_qwen2, tmp_path_factory) -> Path:
    """A GGUF repo's files: two quantizations of one model, a projector and a split file."""
    d = tmp_path_factory.mktemp("gguf-repo")
    write_gguf(tiny_qwen2, d / "tiny-qwen2-Q8_0.gguf", "qwen2", "Q8_0")
    write_gguf(tiny_qwen2, d / "tiny-qwen2-q4_0.gguf", "qwen2", "Q4_0")
    (d / "mmproj-tiny-qwen2-Q8_0.gguf").write_bytes(b"GGUF projector")
    (d / "tiny-qwen2-F16-00001-of-00002.gguf").write_bytes(b"GGUF split")
    (d / "README.md").write_text("a model card")
    return d


@pytest.mark.parametrize(("value", "parts"), [
    ("org/name:Q4_K_M", ("org/name", None, "Q4_K_M")),
    ("org/name:model-q8_0.gguf", ("org/name", None, "model-q8_0.gguf")),
    ("org/name@v1.0:sub/model.gguf", ("org/name", "v1.0", "sub/model.gguf")),
    ("org/name@" + MAIN + ":Q8_0", ("org/name", MAIN, "Q8_0")),
])
def test_gguf_repo_ids(value, parts):
    m = hub._REPO_ID.fullmatch(value)
    assert hub.is_repo_id(value) and (m["repo"], m["revision"], m["gguf"]) == parts


@pytest.mark.parametrize("value", ["org/name:", "org/name::Q8_0", "org/name:Q8_0@main", "org/name: Q8_0"])
def test_not_gguf_repo_ids(value):
    assert not hub.is_repo_id(value)


def test_offline_resolves_a_file_or_a_quantization_from_the_cache(hf_env, gguf_repo, tmp_path):
    hf_env(HF_HUB_OFFLINE="1")
    snapshot = lay_out_cache(tmp_path / "hf-home" / "hub", "org/tiny-qwen2-GGUF", gguf_repo, {"main": MAIN})["main"]
    assert hub.resolve("org/tiny-qwen2-GGUF:tiny-qwen2-Q8_0.gguf") == snapshot / "tiny-qwen2-Q8_0.gguf"
    assert hub.resolve("org/tiny-qwen2-GGUF:q8_0") == snapshot / "tiny-qwen2-Q8_0.gguf"  # not the projector
    assert hub.resolve("org/tiny-qwen2-GGUF@main:Q4_0") == snapshot / "tiny-qwen2-q4_0.gguf"  # any case
    loaded = checkpoint.load(hub.checkpoint_dir(Path("org/tiny-qwen2-GGUF:Q8_0")), quantize="auto")
    assert (loaded.source_format, loaded.quantization) == ("gguf-qwen2", "q8_0")
    with pytest.raises(CheckpointError, match="0 GGUF files of the repo name 'Q6_K'.*name one"):
        hub.resolve("org/tiny-qwen2-GGUF:Q6_K")
    with pytest.raises(CheckpointError, match="split files are not read"):
        hub.resolve("org/tiny-qwen2-GGUF:F16")
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        hub.resolve("org/tiny-qwen2-GGUF:missing.gguf")


def test_a_local_gguf_file_wins_over_a_repo_id(hf_env, gguf_repo, tmp_path, monkeypatch):
    hf_env(HF_HUB_OFFLINE="1")  # nothing in the cache: any hub lookup fails
    monkeypatch.chdir(gguf_repo)
    assert hub.checkpoint_dir(Path("tiny-qwen2-Q8_0.gguf")) == Path("tiny-qwen2-Q8_0.gguf")
    (tmp_path / "org").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "x.gguf").write_bytes((gguf_repo / "tiny-qwen2-Q8_0.gguf").read_bytes())
    assert hub.checkpoint_dir(Path("org/x.gguf")) == Path("org/x.gguf")


def test_only_the_named_file_is_downloaded(hf_env, gguf_repo):
    files = {p.name: p.read_bytes() for p in gguf_repo.iterdir()}
    fake = FakeHub({"org/tiny-qwen2-GGUF": files})
    try:
        hf_env(HF_ENDPOINT=fake.url)
        path = hub.resolve("org/tiny-qwen2-GGUF:Q4_0")
        assert path.name == "tiny-qwen2-q4_0.gguf" and path.read_bytes() == files["tiny-qwen2-q4_0.gguf"]
        downloads = [p for p in fake.paths() if "/resolve/" in p]
        assert downloads and all(p.endswith("tiny-qwen2-q4_0.gguf") for p in downloads), downloads
        with pytest.raises(CheckpointError, match="no file 'absent.gguf'"):
            hub.resolve("org/tiny-qwen2-GGUF:absent.gguf")
    finally:
        fake.close()
