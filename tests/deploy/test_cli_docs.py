"""The CLI and the README stay in step with the settings and the routes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tserve.service.app import build_app
from tserve.service.cli import build_parser, settings_from_args
from tserve.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_setting_is_documented(name):
    assert f"TSERVE_{name.upper()}" in README
    flag = "--model" if name == "models" else f"--{name.replace('_', '-')}"
    assert f"`{flag}" in README


def test_every_route_is_documented():
    app = build_app(Settings(), load_models=False)
    paths = set(app.openapi()["paths"])
    assert paths >= {"/healthz", "/readyz", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                     "/v1/translations", "/v1/classifications"}
    for path in paths:
        assert path in README, path


def test_quick_start_is_make_test_and_make_serve():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^(make \w+)", quick, flags=re.M)
    assert commands == ["make test", "make serve"]


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("TSERVE_PORT", "9001")
    monkeypatch.setenv("TSERVE_MAX_QUEUE", "7")
    monkeypatch.setenv("TSERVE_MODELS", "a=/x,b=/y")
    args = build_parser().parse_args(["serve", "--port", "9002", "--no-warmup", "--model", "c=/z"])
    settings = settings_from_args(args)
    assert settings.port == 9002 and settings.max_queue == 7 and settings.warmup is False
    assert settings.model_specs() == {"c": Path("/z")}
    assert Settings().model_specs() == {"a": Path("/x"), "b": Path("/y")}


def test_quantization_and_speculation_flags_reach_the_settings(monkeypatch):
    monkeypatch.setenv("TSERVE_INT4_GROUP_SIZE", "64")
    args = build_parser().parse_args(["serve", "--quantize", "int4", "--speculative", "ngram",
                                      "--num-speculative-tokens", "6"])
    settings = settings_from_args(args)
    assert (settings.quantize, settings.int4_group_size) == ("int4", 64)
    assert (settings.speculative, settings.num_speculative_tokens) == ("ngram", 6)
    assert settings_from_args(build_parser().parse_args(["serve", "--int4-group-size", "128"])).int4_group_size == 128
    with pytest.raises(ValueError, match="must be one of"):
        Settings(int4_group_size=48)


def test_bad_model_flag_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "tserve", "serve", "--model", "no-equals-sign"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "NAME=PATH" in out.stderr


def test_unknown_checkpoint_ends_the_process(tmp_path):
    """A model given on the command line that cannot load ends the process (exit code 1, the reason on stderr),
    instead of serving half the models or answering 503 for ever."""
    from tests.helpers.server import ServerProcess

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{\"architecture\": \"nonsense\"}")
    srv = ServerProcess(["--model", f"x={tmp_path / 'broken'}"], tmp_path / "server.log")
    try:
        assert srv.proc.wait(timeout=120) == 1
        last = (tmp_path / "server.log").read_text().strip().splitlines()[-1]
        assert last.startswith("tserve: models failed to load:") and "nonsense" in last
    finally:
        srv.stop()
