"""A paragraph of a file as the HTML machinery reads it, and its rendered translation back as a tree.

A format reads each paragraph into *nodes*: text (`str`), a `Group` (something that wraps text and keeps its
formatting: a run's properties, a hyperlink, a styled span) and a `Piece` (something kept whole at one place:
a tab, a line break, an image, a field, a footnote). `to_block` turns the nodes into a `model.html_markup.Block`
whose spans and atoms are private-use marker strings, so `render_block` places them on the target words
aligned to theirs exactly as it places HTML tags; `from_rendered` reads the markers back into a tree of the
same groups (new children) and the same pieces, each exactly once, which the format writes as its own XML."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tserve.model.html_markup import Atom, Block, Span, shift

OPEN, END, CLOSE, ATOM = "\ue000", "\ue001", "\ue002", "\ue003"  # Unicode private use: never in the model's text
_MARKERS = re.compile(f"{OPEN}(\\d+){END}|{ATOM}(\\d+){END}|{CLOSE}")
_SPACE = re.compile(r"\s+")


@dataclass
class Group:
    """Text with formatting of its own: what the format needs to write it again is in `payload`."""

    payload: Any
    children: list[Node] = field(default_factory=list)


@dataclass
class Piece:
    """Kept whole at one place of the text; `breaks`: the model reads a space there (a tab, a line break)."""

    payload: Any
    breaks: bool = False


Node = str | Group | Piece


@dataclass
class Paragraph:
    """A paragraph's block for the translator and the groups and pieces its markers stand for."""

    block: Block
    groups: list[Group]
    pieces: list[Piece]


def to_block(nodes: list[Node]) -> Paragraph | None:
    """The nodes as a block (whitespace runs read as one space, as the formats show them), or None when
    they hold no text to translate."""
    groups: list[Group] = []
    pieces: list[Piece] = []
    text = ""

    def add_text(s: str) -> None:
        nonlocal text
        s = _SPACE.sub(" ", s)
        if text.endswith(" ") or not text:
            s = s.lstrip(" ")
        text += s

    def walk(items: list[Node], out: list[Span | Atom]) -> None:
        nonlocal text
        for n in items:
            if isinstance(n, str):
                if n[:1].isspace():
                    for a in out:
                        if isinstance(a, Atom) and a.at == len(text):
                            a.space_after = True
                add_text(n)
            elif isinstance(n, Group):
                groups.append(n)
                span = Span(f"{OPEN}{len(groups) - 1}{END}", CLOSE, start=len(text))
                out.append(span)
                walk(n.children, span.children)
                span.end = len(text.rstrip(" "))
            else:
                pieces.append(n)
                out.append(Atom(f"{ATOM}{len(pieces) - 1}{END}", len(text), space_before=text.endswith(" "),
                                breaks=n.breaks))
                if n.breaks:
                    add_text(" ")

    children: list[Span | Atom] = []
    walk(nodes, children)
    if not text.strip():
        return None
    lead = len(text) - len(text.lstrip(" "))
    text = text.strip(" ")
    shift(children, -lead, len(text))
    return Paragraph(Block("", text, children, "", {}), groups, pieces)


def from_rendered(rendered: str, paragraph: Paragraph) -> list[Node]:
    """`render_block`'s output for the paragraph as nodes: new groups over the translated text (same payloads),
    the paragraph's own pieces."""
    root: list[Node] = []
    stack = [root]
    pos = 0
    for m in _MARKERS.finditer(rendered):
        if m.start() > pos:
            stack[-1].append(rendered[pos: m.start()])
        pos = m.end()
        if m.group(1) is not None:
            group = Group(paragraph.groups[int(m.group(1))].payload)
            stack[-1].append(group)
            stack.append(group.children)
        elif m.group(2) is not None:
            stack[-1].append(paragraph.pieces[int(m.group(2))])
        elif len(stack) > 1:
            stack.pop()
    if pos < len(rendered):
        stack[-1].append(rendered[pos:])
    return root


def plain_text(nodes: list[Node]) -> str:
    """The text of rendered nodes (for tests and for formats that keep no markup)."""
    return "".join(n if isinstance(n, str) else plain_text(n.children) if isinstance(n, Group) else ""
                   for n in nodes)


def no_escape(text: str) -> str:
    return text
