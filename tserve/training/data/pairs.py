"""Translation pairs: normalising and cleaning, common to every source."""

from __future__ import annotations

import html
import re
import unicodedata
from dataclasses import dataclass

from tserve.training.data.sources import MAX_PAIR_CHARS

# --------------------------------------------------------------------------------------
# Translation pairs: common cleaning
# --------------------------------------------------------------------------------------


LANGUAGE_NAMES = {"en": "English", "de": "German"}  # the two sides of the pairs


@dataclass(frozen=True)
class TranslationPair:
    """One English sentence or phrase with its German translation and where it comes from."""

    en: str
    de: str
    source: str  # one of TRANSLATION_SOURCES

    def side(self, lang: str) -> str:
        """The text in `lang` ("en" or "de"): a German→English trainer reads the same pairs the other way."""
        if lang not in ("en", "de"):
            raise ValueError(f"the translation data are English-German; no {lang!r} side")
        return self.en if lang == "en" else self.de


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
