"""The English-German data set: every source merged, deduplicated and split."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from tserve.training.data.ding import parse_ding
from tserve.training.data.fetch import (
    DataPreparationError,
    _processed_dir,
    _read_jsonl,
    _write_jsonl,
    fetch_deb,
)
from tserve.training.data.libreoffice import parse_libreoffice_help, parse_mo
from tserve.training.data.pairs import TranslationPair, clean_pair
from tserve.training.data.sources import (
    MAX_PAIR_CHARS,
    PROCESSING_VERSION,
    TRANSLATION_TEST_FRAC,
    TRANSLATION_VALID_FRAC,
)
from tserve.training.data.splits import normalise_key, split_by_hash

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# Translation data set
# --------------------------------------------------------------------------------------


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
