"""HTML for translation: the text to translate out of a page, and the page back around its translation.

`parse_html` reads a page with the standard library's parser and cuts it into *blocks*: the runs of text and
inline markup between block-level tags (p, li, h1-h6, td, div, ...). Everything else is kept verbatim: block
tags, whitespace between blocks, comments between blocks, and whole elements whose text is not to be
translated (code, pre, script, style, anything with translate="no"). A block's text is what the model reads
(whitespace runs collapsed to one space, as a browser shows them; entities decoded); its inline elements
(b, a, span, ...) are *spans* over that text, nested as in the page, and its void or untranslated inline
pieces (br, img, an inline code element, a comment) are *atoms* at one place in it.

`render_block` puts a block's spans and atoms into its translation, given which source word each target word
was read from (tserve/model/alignment.py): a span wraps the smallest run of target words that holds every word
aligned into it, nested as in the source; an atom follows the last target word aligned to the source word
before it. Tags are never added or dropped, so the answer has exactly the page's tags and attributes, and it
is well-formed: spans that would cross are shortened, down to empty, rather than interleaved.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser

BLOCK_TAGS = frozenset(
    "address article aside blockquote body caption center dd details dialog dir div dl dt fieldset figcaption "
    "figure footer form h1 h2 h3 h4 h5 h6 head header hgroup hr html legend li main menu nav ol p section "
    "summary table tbody td tfoot th thead title tr ul option optgroup select".split())
KEEP_TAGS = frozenset("code pre script style kbd samp textarea svg math noscript template var".split())
VOID_TAGS = frozenset("area base br col embed hr img input link meta param source track wbr".split())
_WORD = re.compile(r"\w+|[^\w\s]+")  # words and runs of punctuation: a tag may end before a full stop
_HTML_SPACE = re.compile(r"([ \t\n\r\f]+)")  # not U+00A0: &nbsp; is text
BREAK_TAGS = frozenset({"br"})  # void tags that separate words


@dataclass
class Span:
    """An inline element over block text [start, end); `children` nest inside it, in source order."""

    open_tag: str  # verbatim, attributes included
    close_tag: str
    start: int = 0
    end: int = 0
    children: list[Span | Atom] = field(default_factory=list)


@dataclass
class Atom:
    """Markup kept whole at one place of the block text (a void tag, an untranslated element, a comment)."""

    raw: str
    at: int
    space_before: bool = False  # whitespace between it and the text before it in the page
    space_after: bool = False
    after: str = " "  # that whitespace as the page writes it (a newline after a <br>, say)
    breaks: bool = False  # a line break: the model read a space in its place
    opens: bool = False  # an open tag never closed: it starts the text that follows it


@dataclass
class Block:
    """Leading whitespace, the text to translate, its markup, trailing whitespace."""

    lead: str
    text: str
    children: list[Span | Atom]
    trail: str
    entities: dict[str, str]  # decoded character -> the entity the page wrote it as


@dataclass
class Markup:
    """A page as verbatim strings and blocks, in order."""

    parts: list[str | Block]

    @property
    def blocks(self) -> list[Block]:
        return [p for p in self.parts if isinstance(p, Block)]

    def join(self, rendered: list[str]) -> str:
        """The page with each block (in order) replaced by its rendered translation."""
        it = iter(rendered)
        out = [p if isinstance(p, str) else next(it) for p in self.parts]
        if next(it, None) is not None:
            raise ValueError("more rendered blocks than blocks")
        return "".join(out)


class _Reader(HTMLParser):
    """Events in order: ("start"|"end"|"void"|"text"|"raw", tag or text, verbatim)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.events: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:  # noqa: ARG002 - kept verbatim
        raw = self.get_starttag_text() or f"<{tag}>"
        self.events.append(("void" if tag in VOID_TAGS else "start", tag, raw))

    def handle_startendtag(self, tag: str, attrs: list) -> None:  # noqa: ARG002
        self.events.append(("void", tag, self.get_starttag_text() or f"<{tag}/>"))

    def handle_endtag(self, tag: str) -> None:
        self.events.append(("end", tag, f"</{tag}>"))

    def handle_data(self, data: str) -> None:
        self.events.append(("text", data, data))

    def handle_entityref(self, name: str) -> None:
        raw = f"&{name};"
        text = html.unescape(raw)
        self.events.append(("entity", text, raw) if text != raw else ("text", raw, raw))

    def handle_charref(self, name: str) -> None:
        raw = f"&#{name};"
        self.events.append(("entity", html.unescape(raw), raw))

    def handle_comment(self, data: str) -> None:
        self.events.append(("raw", "", f"<!--{data}-->"))

    def handle_decl(self, decl: str) -> None:
        self.events.append(("raw", "", f"<!{decl}>"))

    def handle_pi(self, data: str) -> None:
        self.events.append(("raw", "", f"<?{data}>"))

    def unknown_decl(self, data: str) -> None:
        self.events.append(("raw", "", f"<![{data}]>"))


def _kept_whole(tag: str, raw: str) -> bool:
    return tag in KEEP_TAGS or re.search(r"""\btranslate\s*=\s*["']?no\b""", raw, re.IGNORECASE) is not None


class _BlockBuilder:
    """Collects one block's text and markup while the events of a run of inline content arrive."""

    def __init__(self) -> None:
        self.raw: list[str] = []  # verbatim, for a block that turns out to hold no text
        self.text = ""
        self.root = Span("", "")
        self.stack = [self.root]
        self.entities: dict[str, str] = {}
        self.atoms: list[Atom] = []

    def _add_text(self, text: str) -> None:
        for piece in _HTML_SPACE.split(text):
            if not piece:
                continue
            if _HTML_SPACE.fullmatch(piece):
                if self.text and not self.text.endswith(" "):
                    self.text += " "
            else:
                self.text += piece

    def add_atom(self, raw: str, breaks: bool = False) -> None:
        atom = Atom(raw, len(self.text), space_before=self.text.endswith(" "), breaks=breaks)
        self.stack[-1].children.append(atom)
        self.atoms.append(atom)
        if breaks:  # the model reads a space where a line break separates words
            self._add_text(" ")

    def add_text(self, text: str) -> None:
        if text[:1].isspace():
            for atom in self.atoms:
                # a break's own space (the model's) is already in the text: the page's whitespace follows it
                if atom.at == len(self.text) or atom.breaks and atom.at + 1 == len(self.text):
                    atom.space_after, atom.after = True, text[: len(text) - len(text.lstrip())]
        self._add_text(text)

    def open(self, raw: str, tag: str) -> None:
        span = Span(raw, f"</{tag}>", start=len(self.text))
        self.stack[-1].children.append(span)
        self.stack.append(span)

    def close(self, tag: str, raw: str) -> None:
        if len(self.stack) > 1 and self.stack[-1].close_tag == f"</{tag}>":
            span = self.stack.pop()
            span.end = len(self.text.rstrip(" "))
        else:  # a close tag with no open one in this block: kept where it is
            self.add_atom(raw)

    def finish(self) -> str | Block:
        while len(self.stack) > 1:  # an open tag never closed in this block: kept where it is, as it was
            span = self.stack.pop()
            parent = self.stack[-1].children
            i = parent.index(span)
            opened = Atom(span.open_tag, span.start, space_before=self.text[: span.start].endswith(" "), opens=True)
            parent[i: i + 1] = [opened, *span.children]
        if not self.text.strip():
            return "".join(self.raw)
        first, last = self.raw[0], self.raw[-1]  # the whitespace around the text, kept as the page had it
        lead = first[: len(first) - len(first.lstrip())] if not first.startswith("<") else ""
        trail = last[len(last.rstrip()):] if not last.rstrip().endswith(">") else ""
        text = self.text
        strip_left = len(text) - len(text.lstrip(" "))
        text = text.strip(" ")
        shift(self.root.children, -strip_left, len(text))
        return Block(lead, text, self.root.children, trail, self.entities)


def shift(children: list[Span | Atom], by: int, limit: int) -> None:
    """Moves spans and atoms by `by` characters, kept within [0, limit] (after text is stripped)."""
    for c in children:
        if isinstance(c, Atom):
            c.at = min(max(c.at + by, 0), limit)
        else:
            c.start, c.end = min(max(c.start + by, 0), limit), min(max(c.end + by, 0), limit)
            shift(c.children, by, limit)


def parse_html(page: str) -> Markup:
    """A page as verbatim parts and translatable blocks (see the module's notes)."""
    reader = _Reader()
    reader.feed(page)
    reader.close()
    if reader.rawdata:  # an unfinished tag at the end: text as it stands
        reader.events.append(("text", reader.rawdata, reader.rawdata))
    parts: list[str | Block] = []
    block: _BlockBuilder | None = None
    kept: list[str] | None = None  # the verbatim text of an element kept whole
    kept_tag, depth = "", 0

    def end_block() -> None:
        nonlocal block
        if block is not None:
            parts.append(block.finish())
            block = None

    for kind, value, raw in reader.events:
        if kept is not None:  # inside an element kept whole: count its own tag to find its end
            kept.append(raw)
            if kind == "start" and value == kept_tag:
                depth += 1
            elif kind == "end" and value == kept_tag:
                depth -= 1
                if depth == 0:
                    whole, kept = "".join(kept), None
                    if block is not None:
                        block.raw.append(whole)
                        block.add_atom(whole)
                    else:
                        parts.append(whole)
            continue
        if kind == "start" and _kept_whole(value, raw):
            if value in BLOCK_TAGS:
                end_block()
            kept, kept_tag, depth = [raw], value, 1
            continue
        if value in BLOCK_TAGS and kind in ("start", "end", "void"):
            end_block()
            parts.append(raw)
            continue
        if block is None:
            if kind in ("text", "entity") and not value.strip() and kind == "text":
                parts.append(raw)
                continue
            if kind == "raw":
                parts.append(raw)
                continue
            block = _BlockBuilder()
        block.raw.append(raw)
        if kind == "text":
            block.add_text(html.unescape(value) if "&" in value else value)
        elif kind == "entity":
            block.entities.setdefault(value, raw)
            block.add_text(value)
        elif kind == "start":
            block.open(raw, value)
        elif kind == "end":
            block.close(value, raw)
        else:  # void tags, comments
            block.add_atom(raw, breaks=value in BREAK_TAGS)
    if kept is not None:  # never closed: verbatim
        parts.append("".join(kept))
    end_block()
    return _merge_strings(parts)


def _merge_strings(parts: list[str | Block]) -> Markup:
    out: list[str | Block] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return Markup(out)


def words(text: str, offset: int = 0) -> list[tuple[int, int]]:
    """(start, end) of each word or run of punctuation, shifted by `offset`."""
    return [(m.start() + offset, m.end() + offset) for m in _WORD.finditer(text)]


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------
@dataclass
class _Placed:
    item: Span | Atom
    first: int  # first target word (spans), or the boundary before target word `first` (atoms, empty spans)
    last: int  # last target word; first - 1 for an empty span or an atom
    order: int
    children: list[_Placed] = field(default_factory=list)


def _source_words_of(span: Span, source_words: list[tuple[int, int]]) -> list[int]:
    return [i for i, (s, e) in enumerate(source_words) if s < span.end and e > span.start]


def _boundary_after_source(at: int, source_words: list[tuple[int, int]], aligned: list[int], n_target: int) -> int:
    """The target word boundary for a position of the source text: after the last target word aligned to the
    source word before it, else before the first one aligned to the source word after it, else in proportion."""
    before = [i for i, (_, e) in enumerate(source_words) if e <= at]
    if before:
        hits = [t for t, s in enumerate(aligned) if s == before[-1]]
        if hits:
            return max(hits) + 1
    after = [i for i, (s, _) in enumerate(source_words) if s >= at]
    if after:
        hits = [t for t, s in enumerate(aligned) if s == after[0]]
        if hits:
            return min(hits)
    if not source_words:
        return n_target
    return round(len(before) / len(source_words) * n_target)


def _place(children: list[Span | Atom], lo: int, hi: int, source_words: list[tuple[int, int]],
           aligned: list[int]) -> list[_Placed]:
    """Target word ranges for `children` inside target words [lo, hi) (hi exclusive), nested and not crossing."""
    n_target = len(aligned)
    placed: list[_Placed] = []
    for order, c in enumerate(children):
        if isinstance(c, Atom):
            b = min(max(_boundary_after_source(c.at, source_words, aligned, n_target), lo), hi)
            placed.append(_Placed(c, b, b - 1, order))
            continue
        src = set(_source_words_of(c, source_words))
        hits = [t for t, s in enumerate(aligned) if s in src and lo <= t < hi]
        if not hits and src:  # nothing aligned into it: the target word in the same relative place
            mid = (min(src) + max(src) + 1) / 2 / max(len(source_words), 1)
            hits = [min(max(int(mid * n_target), lo), hi - 1)] if hi > lo else []
        if hits:
            placed.append(_Placed(c, min(hits), max(hits), order))
        else:
            b = min(max(_boundary_after_source(c.start, source_words, aligned, n_target), lo), hi)
            placed.append(_Placed(c, b, b - 1, order))
    # Siblings must not cross: in target order, each starts after the one before ends.
    placed.sort(key=lambda p: (p.first, p.last, p.order))
    edge = lo
    for p in placed:
        if p.last < p.first:  # empty: a boundary
            p.first = max(p.first, edge)
            p.last = p.first - 1
        else:
            p.first = max(p.first, edge)
            p.last = max(p.last, p.first - 1)
            edge = p.last + 1
        if isinstance(p.item, Span):
            p.children = _place(p.item.children, p.first, p.last + 1, source_words, aligned)
    placed.sort(key=lambda p: (p.first, p.last >= p.first, p.last, p.order))
    return placed


def _html_escape(text: str, entities: dict[str, str]) -> str:
    out = html.escape(text, quote=False)
    for char, raw in entities.items():
        if char not in "&<>":
            out = out.replace(char, raw)
    return out


@dataclass(frozen=True)
class TagPlacement:
    """Where one inline piece of markup went: a span's source words and the target words it wraps, or an
    atom's word boundary (it sits before word `boundary`) in the source and in the target."""

    tag: str  # the open tag as the page wrote it (an atom: its whole markup)
    kind: str  # "span" | "atom"
    depth: int  # 0 for the block's own children, 1 inside one span, ...
    source_words: list[int]
    target_words: list[int]
    source_boundary: int | None = None
    target_boundary: int | None = None


def tag_placements(block: Block, source_words: list[tuple[int, int]], aligned: list[int]) -> list[TagPlacement]:
    """Every span and atom of `block`, in the order `render_block` writes them, with the target words it
    placed them on (same arguments as `render_block`)."""
    out: list[TagPlacement] = []

    def walk(items: list[_Placed], depth: int) -> None:
        for p in items:
            if isinstance(p.item, Atom):
                before = sum(1 for _, e in source_words if e <= p.item.at)
                out.append(TagPlacement(p.item.raw, "atom", depth, [], [], before, p.first))
            else:
                out.append(TagPlacement(p.item.open_tag, "span", depth, _source_words_of(p.item, source_words),
                                        list(range(p.first, p.last + 1))))
                walk(p.children, depth + 1)

    walk(_place(block.children, 0, len(aligned), source_words, aligned), 0)
    return out


def render_block(block: Block, target: str, target_words: list[tuple[int, int]],
                 source_words: list[tuple[int, int]], aligned: list[int],
                 escape: Callable[[str], str] | None = None) -> str:
    """`target` (the block's translation) as HTML with the block's spans and atoms placed: `target_words` and
    `source_words` are the (start, end) of each word in `target` and `block.text`, and `aligned[i]` the source
    word that target word i was read from (-1: none). `escape` writes text (default: HTML, with the
    block's entities); a format whose tags are not HTML (a file's runs, Markdown) passes its own."""
    def _escape(text: str, entities: dict[str, str]) -> str:
        return _html_escape(text, entities) if escape is None else escape(text)

    placed = _place(block.children, 0, len(target_words), source_words, aligned)

    def start_of(first: int) -> int:  # where a span starting at target word `first` opens
        return target_words[first][0] if first < len(target_words) else len(target)

    def boundary(b: int) -> int:  # where an atom before target word `b` goes: right after the word before
        return target_words[b - 1][1] if b > 0 else (target_words[0][0] if target_words else 0)

    def render(items: list[_Placed], pos: int, end: int) -> str:
        out = []
        for p in items:
            if p.last < p.first:
                at = max(boundary(p.first), pos)
                atom = p.item if isinstance(p.item, Atom) else None
                spaced = atom is not None and atom.space_before and target[at: at + 1] == " "
                if spaced:
                    at += 1  # after the space, as in the page
                out.append(_escape(target[pos:at], block.entities))
                if atom is not None:
                    out.append(atom.raw)
                    if atom.breaks and target[at: at + 1] == " ":
                        at += 1  # the space the model read for the line break
                    following = target[at: at + 1]
                    if at < end and not atom.opens and (atom.space_after and not following.isspace()
                                                        or spaced and following.isalnum()):
                        out.append(atom.after if atom.space_after else " ")  # the space that took the atom's
                        # place before the next word (as the page wrote it)
                else:
                    out.append(p.item.open_tag + render(p.children, at, at) + p.item.close_tag)
                pos = at
            else:
                s, e = max(start_of(p.first), pos), target_words[p.last][1]
                out.append(_escape(target[pos:s], block.entities))
                out.append(p.item.open_tag + render(p.children, s, e) + p.item.close_tag)
                pos = e
        out.append(_escape(target[pos:end], block.entities))
        return "".join(out)

    return block.lead + render(placed, 0, len(target)) + block.trail
