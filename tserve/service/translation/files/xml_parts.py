"""Translating paragraphs inside the XML parts of a zip container (OOXML, ODF, EPUB's package document).

A format module finds the parts and the paragraphs in them, reads each paragraph into nodes
(`service.translation.files.inline`) with a writer that puts rendered nodes back; this module keeps them in order, gives
the translator their blocks, and builds the container again with only the parts that held text re-serialised
(every other entry byte-identical). All paragraphs are read before any is written: a piece kept whole (a text
box, a footnote) may hold paragraphs of its own, and it is moved, not copied, so they stay the same elements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lxml import etree

from tserve.model.html_markup import Markup
from tserve.service.translation.files.containers import Container, parse_xml, write_xml
from tserve.service.translation.files.inline import Node, Paragraph, from_rendered, to_block

Writer = Callable[[list[Node]], None]


@dataclass
class FileDocument:
    """A file as blocks to translate, how translated text is written into a rendered block, and the file
    again from the blocks' rendered translations (in order)."""

    markup: Markup
    escape: Callable[[str], str] | None  # None: HTML escaping
    write: Callable[[list[str]], bytes]
    media_type: str


class XmlParts:
    def __init__(self, container: Container) -> None:
        self.container = container
        self.trees: dict[str, etree._ElementTree] = {}
        self.paragraphs: list[tuple[Paragraph, Writer]] = []
        self.touched: set[str] = set()  # the parts that hold a paragraph to translate

    def tree(self, name: str) -> etree._ElementTree:
        if name not in self.trees:
            self.trees[name] = parse_xml(self.container.entries[name], name)
        return self.trees[name]

    def add(self, part: str, nodes: list[Node], writer: Writer) -> None:
        paragraph = to_block(nodes)
        if paragraph is not None:
            self.paragraphs.append((paragraph, writer))
            self.touched.add(part)

    def document(self, media_type: str) -> FileDocument:
        return FileDocument(Markup([p.block for p, _ in self.paragraphs]), lambda text: text, self.write, media_type)

    def write(self, rendered: list[str]) -> bytes:
        if len(rendered) != len(self.paragraphs):
            raise ValueError("one rendered block per paragraph")
        for (paragraph, writer), r in zip(self.paragraphs, rendered, strict=True):
            writer(from_rendered(r, paragraph))
        return self.container.write({name: write_xml(self.trees[name], self.container.entries[name])
                                     for name in self.touched})


def element_text(parts: XmlParts, part: str, element: etree._Element) -> None:
    """An element holding plain text only (a document title): its text translated in place."""
    if len(element) or not (element.text or "").strip():
        return

    def write(nodes: list[Node]) -> None:
        element.text = "".join(n for n in nodes if isinstance(n, str))

    parts.add(part, [element.text], write)
