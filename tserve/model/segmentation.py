"""Documents into sentences for translation, and back, keeping the layout.

A document becomes segments (the text to translate, one sentence each) and the layout around them (the
whitespace before, between and after the segments: blank lines, line breaks, spaces), kept verbatim. Joining
the layout with the segments' translations gives the translated document with its paragraphs and lines where
they were.

Rules (no model, nothing downloaded):
- a run of whitespace that holds a line break always ends a segment (paragraphs and lines);
- a sentence ends after `.`, `!`, `?` or `…` (closing quotes and brackets included) when whitespace and then
  anything but a lower-case letter follow, unless the word before the period is a common abbreviation
  (`e.g.`, `Dr.`, `etc.` ...), a single letter (an initial) or a number (`No. 5`);
- a segment that the model cannot take whole (`fits` says) is cut where clause punctuation (`,` `;` `:`
  and dashes) is followed by whitespace, at the candidate closest to its middle, then at the whitespace
  closest to its middle, then in the middle of the characters, until every piece fits;
- spans of a sentence to be kept whole (`keep` says: a glossary term's occurrences) are never cut inside
  while the sentence can be cut elsewhere, so a kept span that fits ends up whole in one piece.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf fig figs no nos vol vols approx dept est inc ltd co corp "
    "jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun ca al p pp ch sec resp "
    "incl excl max min avg ed eds rev gen gov col lt sgt capt cmdr adm".split()
)
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’»)\]]*$")
_LAST_WORD = re.compile(r"(\S+)\.[\"'”’»)\]]*$")
_CLAUSE = re.compile(r"(?<=[,;:—–])\s+|\s+(?=[—–]\s)")
_SPACE = re.compile(r"\s+")
Span = tuple[int, int]  # [start, end) of a sentence's characters


@dataclass(frozen=True)
class Document:
    """`layout` has one more entry than `segments`: what comes before the first segment, between each pair,
    and after the last. A document of whitespace only has no segments."""

    segments: list[str]
    layout: list[str]

    def join(self, translations: Sequence[str]) -> str:
        """The document with each segment replaced by its translation (in order), the layout unchanged."""
        if len(translations) != len(self.segments):
            raise ValueError(f"{len(translations)} translations for {len(self.segments)} segments")
        parts = [self.layout[0]]
        for text, after in zip(translations, self.layout[1:], strict=True):
            parts += [text, after]
        return "".join(parts)


def _ends_sentence(before: str, after: str) -> bool:
    if not after or after[0].islower() or not _SENTENCE_END.search(before):
        return False
    if before.rstrip("\"'”’»)]").endswith("."):
        word = _LAST_WORD.search(before)
        if word is not None:
            w = word.group(1).lstrip("\"'“‘«([").lower()
            if w in ABBREVIATIONS or (len(w) == 1 and w.isalpha()) or w.replace(",", "").isdigit():
                return False
    return True


def split_sentences(text: str) -> Document:
    """Segments at line breaks and sentence ends (see the module's rules)."""
    segments: list[str] = []
    layout: list[str] = []
    start = 0  # where the current segment starts
    lead = _SPACE.match(text)
    if lead:
        layout.append(lead.group())
        start = lead.end()
    else:
        layout.append("")
    for m in _SPACE.finditer(text, start):
        if m.start() == start:
            continue
        if m.end() == len(text) or "\n" in m.group() or _ends_sentence(text[start:m.start()], text[m.end():]):
            segments.append(text[start:m.start()])
            layout.append(m.group())
            start = m.end()
    if start < len(text):
        segments.append(text[start:])
        layout.append("")
    return Document(segments, layout)


def _cut(segment: str, spans: Sequence[Span] = ()) -> tuple[str, str, str]:
    """(head, gap, tail) at the clause break, else the whitespace, else the character closest to the middle;
    never inside one of `spans` (disjoint) unless the segment is one of them."""
    middle = len(segment) / 2
    for pattern in (_CLAUSE, _SPACE):
        cuts = [m for m in pattern.finditer(segment) if 0 < m.start() and m.end() < len(segment)
                and not any(m.start() < end and start < m.end() for start, end in spans)]
        if cuts:
            m = min(cuts, key=lambda c: abs((c.start() + c.end()) / 2 - middle))
            return segment[: m.start()], m.group(), segment[m.end():]
    half = len(segment) // 2
    for start, end in spans:
        if start < half < end:  # the span's nearer end instead, where one lies inside the segment
            ends = [i for i in (start, end) if 0 < i < len(segment)]
            half = min(ends, key=lambda i: abs(i - middle), default=half)
    return segment[:half], "", segment[half:]


def _fit(segment: str, fits: Callable[[str], bool], spans: Sequence[Span] = (),
         keep: Callable[[str], Sequence[Span]] | None = None) -> Document:
    if len(segment) <= 1 or fits(segment):
        return Document([segment], ["", ""])
    if keep is not None:
        spans = keep(segment)
    head, gap, tail = _cut(segment, spans)
    skip = len(head) + len(gap)
    first = _fit(head, fits, [(s, e) for s, e in spans if e <= len(head)])
    second = _fit(tail, fits, [(s - skip, e - skip) for s, e in spans if s >= skip])
    return Document(first.segments + second.segments, first.layout[:-1] + [gap] + second.layout[1:])


def split_document(text: str, fits: Callable[[str], bool] | None = None,
                   keep: Callable[[str], Sequence[Span]] | None = None) -> Document:
    """Sentences of `text`; with `fits`, each cut further until `fits(piece)` holds for every piece. `keep`: the
    (start, end) spans of a sentence that does not fit that no cut may split (disjoint; asked only then)."""
    doc = split_sentences(text)
    if fits is None:
        return doc
    segments, layout = [], [doc.layout[0]]
    for segment, after in zip(doc.segments, doc.layout[1:], strict=True):
        part = _fit(segment, fits, keep=keep)
        segments += part.segments
        layout += part.layout[1:-1] + [after]
    return Document(segments, layout)
