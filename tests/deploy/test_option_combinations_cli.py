"""The command line where its options meet: a --model path holding '=' or '~', TSERVE_MODELS as a JSON list (a path
with a comma), TSERVE_TASK_MODULES split as its flag is, a directory and a GGUF file of one name in the models
directory; a revision beside a GGUF file or quantization of a Hugging Face repo, and a quantization named in another
case than the repo's file; what `tserve serve` hands to the HTTP server (keep-alive, drain time) from flags and from
TSERVE_*, and a server of a model repository alone; `tserve models load NAME --path`; `make serve SERVE_ARGS=...`;
the defaults docs/SETTINGS.md gives, read as their variables; every TSERVE_* name the deploy files and
docs/DEPLOY.md use being one that is read. All in this process (but `make -n`), without a network or a model
loaded, in seconds."""

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.model.test_gguf_hub import gguf_repo  # noqa: F401 - fixture: a GGUF repo's files
from tests.model.test_hub import MAIN, V1, hf_env, lay_out_cache, tiny_qwen2  # noqa: F401 - fixtures
from tserve.model import hub
from tserve.service.cli import build_parser, main, settings_from_args
from tserve.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch):
    """No TSERVE_* setting from the environment running the tests."""
    for key in list(os.environ):
        if key.startswith("TSERVE_"):
            monkeypatch.delenv(key)
    return monkeypatch


# ------------------------------------------------------------------------------------------------------------
# Model specs
# ------------------------------------------------------------------------------------------------------------
def test_a_model_path_keeps_its_equals_signs_commas_and_home_from_a_flag_and_from_the_environment(clean_env):
    """NAME=PATH splits at the first '=': a run directory named `lr=0.1` stays in the path. The environment's
    JSON list keeps a path with a comma whole, and `~` is the user's home either way."""
    args = build_parser().parse_args(["serve", "--model", "a=/runs/lr=0.1/ckpt", "--model", "b=~/models/b"])
    assert settings_from_args(args).model_specs() == {"a": Path("/runs/lr=0.1/ckpt"),
                                                      "b": Path.home() / "models" / "b"}
    clean_env.setenv("TSERVE_MODELS", '["c=/runs/bs=8,lr=0.1", "d=~/d"]')
    assert Settings().model_specs() == {"c": Path("/runs/bs=8,lr=0.1"), "d": Path.home() / "d"}
    clean_env.setenv("TSERVE_MODELS", "e=/x=1, f=org/repo@v1:Q8_0")
    assert Settings().model_specs() == {"e": Path("/x=1"), "f": Path("org/repo@v1:Q8_0")}


def test_a_model_path_written_relative_stays_a_path_not_a_repo_id(clean_env, tmp_path, monkeypatch):
    """`--model x=./org/name` names a directory (one not there is reported missing), where `x=org/name` is a
    Hugging Face repo id: the leading `./` a Path would drop must not turn the one into the other."""
    from tserve.model import hub

    monkeypatch.chdir(tmp_path)
    specs = Settings(models=["x=./org/name", "y=../up/name", "z=org/name"]).model_specs()
    assert specs["x"] == tmp_path / "org" / "name" and specs["y"] == (tmp_path / ".." / "up" / "name")
    assert not hub.is_repo_id(str(specs["x"])) and not hub.is_repo_id(str(specs["y"]))
    assert hub.is_repo_id(str(specs["z"]))


def test_task_modules_from_the_environment_are_split_as_the_flag_is(clean_env):
    """TSERVE_TASK_MODULES is a comma-separated list like TSERVE_API_KEYS, and the flag reads the same way."""
    clean_env.setenv("TSERVE_TASK_MODULES", "pkg.one, pkg.two")
    assert Settings().task_modules == ["pkg.one", "pkg.two"]
    args = build_parser().parse_args(["serve", "--task-modules", "pkg.three,pkg.four"])
    assert settings_from_args(args).task_modules == ["pkg.three", "pkg.four"]


def test_a_checkpoint_directory_wins_over_a_gguf_file_of_its_name_in_the_models_directory(clean_env, tmp_path):
    """Without --model every checkpoint of --models-dir is served: `lm/` and `lm.gguf` side by side serve the
    directory as `lm`; a GGUF file of another name is served under its stem."""
    models = tmp_path / "models"
    (models / "lm").mkdir(parents=True)
    (models / "lm" / "config.json").write_text("{}")
    (models / "lm.gguf").write_bytes(b"GGUF")
    (models / "small.gguf").write_bytes(b"GGUF")
    (models / "notes").mkdir()
    clean_env.setenv("TSERVE_MODELS_DIR", str(models))
    assert Settings().model_specs() == {"lm": models / "lm", "small": models / "small.gguf"}
    args = build_parser().parse_args(["serve", "--models-dir", str(models)])
    assert settings_from_args(args).model_specs() == {"lm": models / "lm", "small": models / "small.gguf"}


# ------------------------------------------------------------------------------------------------------------
# GGUF files of Hugging Face repos at a revision
# ------------------------------------------------------------------------------------------------------------
def test_a_revision_picks_the_gguf_file_and_the_quantization_of_that_revision(hf_env, gguf_repo, tmp_path):  # noqa: F811
    """`ORG/REPO@v1:FILE.gguf` and `ORG/REPO@v1:QUANT` read the v1 snapshot, not main's: the revision reaches
    both ways of naming one GGUF file, as it reaches a whole snapshot."""
    hf_env(HF_HUB_OFFLINE="1")
    snapshots = lay_out_cache(tmp_path / "hf-home" / "hub", "org/tiny-qwen2-GGUF", gguf_repo,
                              {"main": MAIN, "v1": V1})
    assert snapshots["main"] != snapshots["v1"]
    for revision, ref in (("@v1", "v1"), (f"@{V1}", "v1"), ("", "main"), ("@main", "main")):
        expected = snapshots[ref] / "tiny-qwen2-Q8_0.gguf"
        assert hub.resolve(f"org/tiny-qwen2-GGUF{revision}:tiny-qwen2-Q8_0.gguf") == expected, revision
        assert hub.resolve(f"org/tiny-qwen2-GGUF{revision}:Q8_0") == expected, revision
        assert hub.resolve(f"org/tiny-qwen2-GGUF{revision}:q4_0") == snapshots[ref] / "tiny-qwen2-q4_0.gguf"


# ------------------------------------------------------------------------------------------------------------
# What `tserve serve` hands to the HTTP server
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def served(clean_env):
    """`tserve serve`'s main in this process, with an HTTP server that records what it was given and never runs
    (nor loads a model); the logging and signal handler serve() sets are put back afterwards."""
    from tserve.service import shutdown

    made: list[dict] = []

    class RecordingServer:
        def __init__(self, config, registry, drain_timeout_s: float) -> None:  # noqa: ANN001
            made.append({"config": config, "drain_timeout_s": drain_timeout_s})

        def handle_exit(self, sig, frame) -> None:  # noqa: ANN001
            pass

        def run(self) -> None:
            pass

    clean_env.setattr(shutdown, "DrainingServer", RecordingServer)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, signal.getsignal(signal.SIGTERM),
             {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate, logging.getLogger(n).disabled)
              for n in ("uvicorn", "uvicorn.error", "uvicorn.access")})
    yield made
    root.handlers[:], root.level = saved[0], saved[1]
    signal.signal(signal.SIGTERM, saved[2])
    for n, (handlers, propagate, disabled) in saved[3].items():
        logger = logging.getLogger(n)
        logger.handlers[:], logger.propagate, logger.disabled = handlers, propagate, disabled


def test_keep_alive_and_drain_time_reach_the_http_server_from_flags_and_from_the_environment(served, clean_env,
                                                                                            tmp_path):
    """--keep-alive-s is how long uvicorn keeps an idle connection; --request-timeout-s how long it, and the
    drain, wait for running requests at shutdown (uvicorn's whole seconds rounded up: 12.5 s waits 13, not 12).
    Each from its flag, and from TSERVE_* when no flag is given."""
    model = ["--model", f"lm={tmp_path / 'lm'}"]
    assert main(["serve", *model, "--keep-alive-s", "31", "--request-timeout-s", "12.5", "--port", "8123"]) == 0
    clean_env.setenv("TSERVE_KEEP_ALIVE_S", "44")
    clean_env.setenv("TSERVE_REQUEST_TIMEOUT_S", "9")
    assert main(["serve", *model]) == 0
    assert main(["serve", *model, "--keep-alive-s", "2"]) == 0
    got = [(m["config"].timeout_keep_alive, m["config"].timeout_graceful_shutdown, m["drain_timeout_s"],
            m["config"].port) for m in served]
    assert got == [(31, 13, 12.5, 8123), (44, 9, 9.0, 8000), (2, 9, 9.0, 8000)]


def test_a_model_repository_alone_is_enough_to_start_without_bundled_models(served, clean_env, tmp_path, capsys):
    """No --model and no bundled models: the server refuses to start, unless --model-repository gives it models
    to load at run time, when it starts with none."""
    empty, repository = tmp_path / "empty", tmp_path / "repository"
    empty.mkdir(), repository.mkdir()
    assert main(["serve", "--models-dir", str(empty)]) == 2
    assert "no models to serve" in capsys.readouterr().err and not served
    assert main(["serve", "--models-dir", str(empty), "--model-repository", str(repository)]) == 0
    clean_env.setenv("TSERVE_MODEL_REPOSITORY", str(repository))
    assert main(["serve", "--models-dir", str(empty)]) == 0
    assert len(served) == 2


# ------------------------------------------------------------------------------------------------------------
# `tserve models`
# ------------------------------------------------------------------------------------------------------------
def test_models_load_sends_its_path_as_a_load_parameter_to_the_named_model(monkeypatch, capsys):
    """`tserve models load NAME --path DIR` asks /v2/repository/models/NAME/load (the name quoted) for DIR in
    the body's `parameters`, where the server reads it; without --path the body is empty (NAME in the
    server's --model-repository)."""
    sent: list[tuple] = []

    def post(url: str, json: dict, headers: dict, timeout: float | None) -> httpx.Response:
        sent.append((url, json, headers))
        return httpx.Response(200, json={"state": "READY"})

    monkeypatch.setattr(httpx, "post", post)
    monkeypatch.delenv("TSERVE_ADMIN_KEY", raising=False)
    assert main(["models", "load", "my lm", "--path", "/ckpt/lm", "--url", "http://h:9/", "--key", "k1"]) == 0
    assert main(["models", "load", "mt", "--url", "http://h:9"]) == 0
    assert main(["models", "unload", "mt", "--url", "http://h:9"]) == 0
    assert sent == [("http://h:9/v2/repository/models/my%20lm/load", {"parameters": {"path": "/ckpt/lm"}},
                     {"Authorization": "Bearer k1"}),
                    ("http://h:9/v2/repository/models/mt/load", {}, {}),
                    ("http://h:9/v2/repository/models/mt/unload", {}, {})]
    assert capsys.readouterr().out.splitlines() == ["my lm\tREADY", "mt\tREADY", "mt\tREADY"]


# ------------------------------------------------------------------------------------------------------------
# make serve, the settings table, the deploy files
# ------------------------------------------------------------------------------------------------------------
def test_make_serve_runs_tserve_serve_with_its_serve_args():
    """`make serve SERVE_ARGS=...` (README's quick start) runs the project's `tserve serve` with those flags,
    and they parse as settings."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    out = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/bin/.installed", "serve",
                          "SERVE_ARGS=--port 9123 --no-warmup --model lm=/x=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True, env=env).stdout
    command = next(line for line in out.splitlines() if "tserve serve" in line).split()
    assert command[:2] == [".venv/bin/tserve", "serve"], out
    settings = settings_from_args(build_parser().parse_args(command[1:]))
    assert (settings.port, settings.warmup, settings.model_specs()) == (9123, False, {"lm": Path("/x=1")})


def _documented_defaults() -> dict[str, str]:
    rows = [line for line in (ROOT / "docs" / "SETTINGS.md").read_text().splitlines() if line.startswith("| `--")]
    defaults = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        defaults[re.match(r"`TSERVE_(\w+)`", cells[1])[1].lower()] = cells[2]
    return defaults


def test_the_documented_defaults_are_the_settings_defaults(clean_env):
    """docs/SETTINGS.md's default column, where it gives a value (`16`, `auto`, on / off, none), is the default
    the server runs with: the value, set as its TSERVE_* variable, reads as the setting's default."""
    defaults = _documented_defaults()
    assert set(defaults) == set(Settings.model_fields)
    checked = 0
    for name, cell in defaults.items():
        field = Settings.model_fields[name]
        default = field.default if field.default_factory is None else field.default_factory()
        if field.annotation is bool:
            assert cell in ("on", "off", "`true`", "`false`"), (name, cell)
            assert default is (cell in ("on", "`true`")), (name, cell, default)
        elif m := re.fullmatch(r"`([^`]*)`(?:\s*\(.*\))?", cell):
            clean_env.setenv(f"TSERVE_{name.upper()}", m[1])
            assert getattr(Settings(), name) == default, (name, cell, default)
            clean_env.delenv(f"TSERVE_{name.upper()}")
        elif re.fullmatch(r"none(?:\s*\(.*\))?", cell):
            assert default in (None, []), (name, cell, default)
        else:  # described in words ("model's, at most 4096"): not a value to compare
            continue
        checked += 1
    assert checked >= 55


def _ray_option_names() -> set[str]:
    """TSERVE_RAY_* variables: the fields of deploy/ray_serve.py's RayServeOptions (read without importing Ray)."""
    tree = ast.parse((ROOT / "deploy" / "ray_serve.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RayServeOptions")
    return {f"TSERVE_RAY_{n.target.id.upper()}" for n in cls.body if isinstance(n, ast.AnnAssign)
            and n.target.id != "model_config"}


def test_every_tserve_variable_the_deploy_files_name_is_read(clean_env):
    """Every TSERVE_* name in the deploy files and docs/DEPLOY.md, their comments and examples included (a
    secret's `--from-literal=`, a commented-out line to uncomment), is a server setting or a Ray deployment
    option: a misspelt one would be ignored without a word (the settings ignore unknown variables)."""
    settings = {f"TSERVE_{n.upper()}" for n in Settings.model_fields}
    # Kubernetes' service links, named in the comments that explain why they are turned off.
    service_links = {"TSERVE_SERVICE_HOST", "TSERVE_PORT_8000_TCP"}
    known = settings | _ray_option_names() | service_links
    files = [p for p in sorted((ROOT / "deploy").rglob("*"))
             if p.is_file() and p.suffix not in (".json", ".pyc") and "__pycache__" not in p.parts]
    files += [ROOT / "Dockerfile", ROOT / "docs" / "DEPLOY.md"]
    unknown, seen = [], set()
    for path in files:
        for name in re.findall(r"TSERVE_[A-Z0-9_]+", path.read_text()):
            if name.endswith("_"):  # a prefix: `TSERVE_RAY_*`, env_prefix="TSERVE_RAY_"
                continue
            seen.add(name)
            if name not in known:
                unknown.append(f"{path.relative_to(ROOT)}: {name}")
    assert not unknown, unknown
    assert {"TSERVE_API_KEYS", "TSERVE_MODELS", "TSERVE_RAY_NUM_REPLICAS"} <= seen
