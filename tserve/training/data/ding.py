"""Ding / FreeDict: the English-German dictionary and its example sentences."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

from tqdm.auto import tqdm

from tserve.training.data.pairs import clean_pair, looks_like_sentence, normalise_text

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
