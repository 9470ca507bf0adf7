"""Deterministic splits: an item's split is a function of a hash of its normalised key alone."""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Callable, Iterable

from tserve.training.data.sources import T

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
