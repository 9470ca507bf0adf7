"""What `pip install .` puts in site-packages: one importable package, `tserve`, with its data files, and the
`tserve` command; `python -m tserve` is that command."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
