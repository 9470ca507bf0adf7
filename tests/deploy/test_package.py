"""What `pip install .` puts in site-packages: one importable package, `tserve`, with its data files, and the
`tserve` command; `python -m tserve` is that command."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # builds the wheel: 2-5 s
def test_the_wheel_holds_one_top_level_package_tserve_and_its_command(tmp_path):
    """The wheel pip builds and installs for `pip install .`, built from a copy of the sources (the build writes
    egg-info and build/ beside them): only `tserve/` and its metadata at the top, so that no `model` or
    `service` of ours collides with another project's; the page and the kernels' sources inside."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "tserve", source / "tserve", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "wheel").glob("tserve-*.whl")))
    names = wheel.namelist()
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert {n.split("/")[0] for n in names} == {"tserve", dist_info}
    assert {"tserve/__main__.py", "tserve/model/kernels/paged_decode.cpp", "tserve/service/static/translate.html",
            "tserve/training/cli.py"} <= set(names)
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "tserve = tserve.service.cli:main" in entry_points


@pytest.mark.slow
def test_python_dash_m_tserve_is_the_command():
    out = subprocess.run([sys.executable, "-m", "tserve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout


def test_every_file_the_architecture_map_names_exists():
    """docs/ARCHITECTURE.md (the map, and its table of where each rule lives) names files that exist."""
    import re

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = set(re.findall(r"(?<![\w/.])((?:tserve|bench|tests|deploy|docs)/[\w/.\-]*\w)", text))
    paths = {p for p in paths if "<" not in p}
    assert len(paths) > 40
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"


def _imports(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports anywhere in its text (at the top, inside functions, under
    TYPE_CHECKING): every edge, so that no lazy import hides a circle; importing a module is an edge to each
    package above it too, whose `__init__` runs first. A module's import of its own package (`__init__`) is not
    an edge."""
    import ast

    files = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for package in packages for f in (root / package).rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in map(known, targets) if t and t != name and not name.startswith(t + ".")}
    for name, targets in graph.items():  # importing a.b.c runs a/__init__ and a/b/__init__ first
        parents = {p for t in targets for p in _packages_of(t) if p in files}
        graph[name] = targets | {p for p in parents if p != name and not name.startswith(p + ".")}
    return graph


def _packages_of(module: str) -> list[str]:
    """The packages whose `__init__` importing `module` runs: `a.b.c` -> `a`, `a.b`."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circles_in_the_package_the_benchmarks_or_the_tests():
    graph = _imports(ROOT, ("tserve", "bench", "tests"))
    assert len(graph) > 250
    assert _circles(graph) == []
    # and the test sees a circle where there is one
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_model_library_imports_nothing_of_the_service_or_the_training():
    graph = _imports(ROOT, ("tserve",))
    reaching_up = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("tserve.model")
                         for t in targets if t.startswith(("tserve.service", "tserve.training")))
    assert reaching_up == []


def test_only_the_task_modules_branch_on_a_task_name():
    """Routes, the registry and the engine ask a served model what it can do (`drafts`, `has_logit_lens`,
    `embeds`, ...); they never compare its task with a task's name."""
    import re

    branch = re.compile(r"\.task\s*(==|!=|not in|in)\s*[(\[{]?\s*[\"']")
    service = ROOT / "tserve" / "service"
    found = [f"{f.relative_to(ROOT)}:{i}" for f in sorted(service.rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []


def test_no_route_reaches_into_an_engine():
    """Routes parse, call the served model and render: a route never reads a model's `engine` (the served model
    offers what a request needs: submit, events, call jobs, limits)."""
    import ast

    found = [f"{f.relative_to(ROOT)}:{node.lineno}" for f in sorted((ROOT / "tserve" / "service" / "routes").glob("*.py"))
             for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.Attribute) and node.attr == "engine"]
    assert found == []


def test_each_shared_request_limit_has_one_place():
    """The limits every API shares (`service/limits.py`) are stated there only: no other module words them."""
    wordings = ("in one request; the limit is", "exceeds the server's limit", "characters; the limit is")
    found = [f"{f.relative_to(ROOT)}: {w}" for f in sorted((ROOT / "tserve").rglob("*.py"))
             if f.name != "limits.py" for w in wordings if w in f.read_text()]
    assert found == []


def test_bench_imports_nothing_from_tests():
    """The benchmark scripts take what they share with the tests (tiny checkpoints, a server process) from the
    package's `tserve.testing`, never from the test suite's helpers: imports at any depth, lazy ones included."""
    import ast

    found = []
    for f in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [f"{f.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"]
    assert found == []


def test_the_service_model_and_training_never_import_the_testing_kit():
    """`tserve.testing` (tiny checkpoints, a server process) is for tests and benchmarks: the service, the model
    library and the training never import it."""
    graph = _imports(ROOT, ("tserve",))
    found = sorted(f"{m} -> {t}" for m, targets in graph.items() if not m.startswith("tserve.testing")
                   for t in targets if t == "tserve.testing" or t.startswith("tserve.testing."))
    assert found == []
