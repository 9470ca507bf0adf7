"""The CLI and the docs stay in step with the settings and the routes: every setting is in docs/SETTINGS.md,
every route in docs/API.md; README.md stays a one-page quick start whose links, like every relative link of
the docs, lead to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tserve.service.app import build_app
from tserve.service.cli import build_parser, settings_from_args
from tserve.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SETTINGS_DOC = (ROOT / "docs" / "SETTINGS.md").read_text()
API_DOC = (ROOT / "docs" / "API.md").read_text()
README_MAX_LINES = 150


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_setting_is_documented(name):
    assert f"TSERVE_{name.upper()}" in SETTINGS_DOC
    flag = "--model" if name == "models" else f"--{name.replace('_', '-')}"
    assert f"`{flag}" in SETTINGS_DOC


def test_every_route_is_documented():
    app = build_app(Settings(), load_models=False)
    paths = set(app.openapi()["paths"])
    assert paths >= {"/healthz", "/readyz", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                     "/v1/translations", "/v1/classifications"}
    for path in paths:
        assert path in API_DOC, path


def test_quick_start_is_make_test_and_make_serve():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^(make \w+)", quick, flags=re.M)
    assert commands == ["make test", "make serve"]


# --------------------------------------------------------------------------------------------------------
# README.md is a quick start; its links, and every relative link of the docs, lead somewhere
# --------------------------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks (a `](` inside an example is not a link)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def relative_links(page: Path) -> list[str]:
    """Every link target of a Markdown page that is neither a URL with a scheme nor mail."""
    targets = LINK.findall(prose(page.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, flags=re.I)]


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens (a
    repeated heading gets -1, -2, ...)."""
    anchors: set[str] = set()
    for line in prose(page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]


def test_readme_is_a_short_quick_start():
    lines = README.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def test_readme_links_every_docs_page_and_each_exists():
    linked = {(ROOT / target.split("#", 1)[0]).resolve() for target in relative_links(ROOT / "README.md")
              if target.startswith("docs/") and target.split("#", 1)[0].endswith(".md")}
    assert linked, "README.md links no docs page"
    missing = sorted(str(p.relative_to(ROOT)) for p in linked if not p.is_file())
    assert not missing, f"README.md links docs pages that do not exist: {missing}"
    unlisted = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked)
    assert not unlisted, f"README.md's map of docs/ leaves out {unlisted}"


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    """Files and images a page links exist (relative to the page), and so do the headings its anchors name."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_benchmarks_open_with_the_current_figures():
    """docs/BENCHMARKS.md opens with the table of the latest figures; the dated runs are in docs/benchmarks/,
    each page linked from it."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    first_section = re.search(r"^## (.+)$", text, flags=re.M)
    assert first_section and first_section.group(1) == "Current figures"
    header = next(line for line in text.splitlines() if line.startswith("| workload"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "workload", "figure", "anchor", "ratio", "CPU or GPU", "date", "commit", "command"]
    linked = {t.split("#", 1)[0] for t in relative_links(ROOT / "docs" / "BENCHMARKS.md")}
    history = {f"benchmarks/{p.name}" for p in (ROOT / "docs" / "benchmarks").glob("*.md")}
    assert history and history <= linked, sorted(history - linked)


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


def test_bad_model_flag_is_a_clear_error(capsys):
    from tserve.service.cli import main  # in this process: a new interpreter's imports cost seconds

    assert main(["serve", "--model", "no-equals-sign"]) == 2
    assert "NAME=PATH" in capsys.readouterr().err


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


@pytest.mark.slow
def test_a_test_server_whose_port_was_taken_meanwhile_starts_on_another(tmp_path, monkeypatch):
    """Between a port's choice and its bind another process may take it (the suite's workers start servers at
    once): the server process then starts again on another port instead of failing the test."""
    import socket

    from tests.helpers import factories
    from tests.helpers.server import ServerProcess
    from tserve.testing import server as testing_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        choose = testing_server.port_nobody_else_takes
        monkeypatch.setattr(testing_server, "port_nobody_else_takes", lambda: next(ports, None) or choose())
        srv = ServerProcess(["--model", f"lm={factories.tiny_lm_dir(tmp_path / 'lm')}"], tmp_path / "server.log")
        try:
            srv.wait_ready()
            assert srv.port != taken.getsockname()[1] and "address already in use" in srv.log()
        finally:
            srv.stop()


# Each metric's labels, as dashboards and autoscalers query them: by model, but the request counters and latency
# (by route, and status), the file jobs (by how they ended) and the collector's pauses (by generation); the
# translation memory's size is the server's.
METRIC_LABELS = {"tserve_requests": ("route", "status"), "tserve_request_latency_seconds": ("route",),
                 "tserve_translation_file_jobs": ("status",), "tserve_translation_memory_entries": (),
                 "tserve_gc_pause_seconds": ("generation",)}


def test_every_metric_is_documented_with_its_labels():
    from tserve.service.metrics import Metrics

    collectors = list(Metrics().registry._collector_to_names)
    assert len(collectors) > 25
    for c in collectors:
        assert c._labelnames == METRIC_LABELS.get(c._name, ("model",)), c._name
        documented = c._name + ("_total" if c._type == "counter" else "")
        assert f"`{documented}" in API_DOC, f"{documented} is not in docs/API.md"
