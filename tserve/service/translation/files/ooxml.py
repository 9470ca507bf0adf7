"""Word (.docx) and PowerPoint (.pptx) files: the paragraphs of the body, headers, footers, footnotes,
endnotes, comments, tables, text boxes, slides and slide notes, and the document title.

A paragraph's runs are flat: each carries its properties (`w:rPr` / `a:rPr`: bold, italic, underline,
colour, a slide's hyperlink). The properties most of the paragraph's text has are its base; every stretch of
runs with other properties becomes a group, as does each hyperlink, insertion or smart tag around runs.
Translated text is written as new runs with the properties of the group it landed in (the base outside
them). Tabs, breaks, drawings (with their text boxes), fields (every run from a field's begin to its end),
footnote references, bookmarks and anything else that is not text are pieces: the original elements, moved to
where the alignment puts them. Spelling marks and last-rendered page breaks are layout caches and dropped."""

from __future__ import annotations

import copy
import re
from collections import Counter

from lxml import etree

from tserve.service.translation.files.containers import Container, FileRefused, Limits
from tserve.service.translation.files.inline import Group, Node, Piece
from tserve.service.translation.files.xml_parts import FileDocument, XmlParts, element_text

W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
A = "http://schemas.openxmlformats.org/drawingml/2006/main"
DC = "http://purl.org/dc/elements/1.1/"
XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"

DOCX_PARTS = re.compile(r"word/(document|header\d*|footer\d*|footnotes|endnotes|comments)\.xml")
PPTX_PARTS = re.compile(r"ppt/(slides/slide|notesSlides/notesSlide)\d+\.xml")
DOCX_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
PPTX_TYPE = "application/vnd.openxmlformats-officedocument.presentationml.presentation"


def _q(ns: str, tag: str) -> str:
    return f"{{{ns}}}{tag}"


class _Word:
    ns = W
    wrappers = {_q(W, t) for t in ("hyperlink", "ins", "smartTag", "customXml")}
    dropped = {_q(W, t) for t in ("proofErr", "lastRenderedPageBreak")}
    breaks = {_q(W, t) for t in ("tab", "br", "cr", "ptab")}
    kept_last: set[str] = set()


class _Drawing:
    ns = A
    wrappers: set[str] = set()
    dropped: set[str] = set()
    breaks = {_q(A, "br")}
    kept_last = {_q(A, "endParaRPr")}


def _key(props: etree._Element | None) -> bytes:
    return b"" if props is None else etree.tostring(props)


class _RunReader:
    """One paragraph's nodes (see the module's notes): items are read first, then grouped by properties once
    the paragraph's base (the properties most of its text has) is known."""

    def __init__(self, kind: type, p: etree._Element) -> None:
        self.kind, self.p = kind, p
        self.field_depth = 0
        self.chars: Counter[bytes] = Counter()
        self.props: dict[bytes, etree._Element | None] = {}

    def items(self, parent: etree._Element) -> list[tuple]:
        """(properties' key, str | Piece) or ("wrapper", element, its items), in order."""
        k, out = self.kind, []
        for child in parent:
            tag = child.tag
            if tag == _q(k.ns, "pPr") or tag in k.kept_last or tag in k.dropped:
                continue
            if tag == _q(k.ns, "r"):
                out += self.run(child)
            elif tag in k.wrappers:
                out.append(("wrapper", child, self.items(child)))
            else:  # DrawingML's a:br and a:fld sit beside runs; bookmarks, deletions, maths, content controls
                out.append((None, Piece(("element", child), breaks=tag in k.breaks)))
        return out

    def run(self, r: etree._Element) -> list[tuple]:
        k = self.kind
        props = r.find(_q(k.ns, "rPr"))
        chars = r.findall(_q(k.ns, "fldChar"))
        if self.field_depth or chars or r.find(_q(k.ns, "instrText")) is not None:
            for c in chars:  # a field, begin to end, is kept whole: its result is the application's to compute
                kind = c.get(_q(k.ns, "fldCharType"))
                self.field_depth += 1 if kind == "begin" else -1 if kind == "end" else 0
            return [(None, Piece(("element", r)))]
        key = _key(props)
        self.props.setdefault(key, props)
        out: list[tuple] = []
        for child in r:
            if child is props or child.tag in k.dropped:
                continue
            if child.tag == _q(k.ns, "t"):
                out.append((key, child.text or ""))
                self.chars[key] += len(child.text or "")
            else:
                out.append((key, Piece(("run", props, child), breaks=child.tag in k.breaks)))
        return out

    def grouped(self, items: list[tuple], base: bytes) -> list[Node]:
        """Consecutive items with the same properties, other than the base, as one group."""
        out: list[Node] = []
        for item in items:
            if item[0] == "wrapper":
                out.append(Group(("wrapper", item[1]), self.grouped(item[2], base)))
                continue
            key, node = item
            if key is None or key == base:
                out.append(node)
            elif out and isinstance(out[-1], Group) and out[-1].payload == ("props", key):
                out[-1].children.append(node)
            else:
                out.append(Group(("props", key), [node]))
        return out


def _paragraph(parts: XmlParts, part: str, kind: type, p: etree._Element) -> None:
    reader = _RunReader(kind, p)
    items = reader.items(p)
    base = reader.chars.most_common(1)[0][0] if reader.chars else b""
    props = dict(reader.props)

    def write(rendered: list[Node]) -> None:
        keep_first = [c for c in p if c.tag == _q(kind.ns, "pPr")]
        keep_last = [c for c in p if c.tag in kind.kept_last]
        for c in list(p):
            p.remove(c)
        for c in keep_first:
            p.append(c)
        _write(p, rendered, props.get(base), props, kind.ns)
        for c in keep_last:
            p.append(c)

    parts.add(part, reader.grouped(items, base), write)


def _text_run(ns: str, props: etree._Element | None, text: str) -> etree._Element:
    r = etree.Element(_q(ns, "r"))
    if props is not None:
        r.append(copy.deepcopy(props))
    t = etree.SubElement(r, _q(ns, "t"))
    t.text = text
    if ns == W and text != text.strip():
        t.set(XML_SPACE, "preserve")
    return r


def _write(parent: etree._Element, nodes: list[Node], props: etree._Element | None,
           by_key: dict[bytes, etree._Element | None], ns: str) -> None:
    for n in nodes:
        if isinstance(n, str):
            if n:
                parent.append(_text_run(ns, props, n))
        elif isinstance(n, Group):
            if n.payload[0] == "props":
                _write(parent, n.children, by_key.get(n.payload[1]), by_key, ns)
            else:
                original = n.payload[1]
                wrapper = etree.SubElement(parent, original.tag, attrib=dict(original.attrib))
                _write(wrapper, n.children, props, by_key, ns)
        else:
            what = n.payload
            if what[0] == "run":  # a tab, break or drawing of a run: a run of its own, its properties kept
                r = etree.SubElement(parent, _q(ns, "r"))
                if what[1] is not None:
                    r.append(copy.deepcopy(what[1]))
                what[2].tail = None
                r.append(what[2])
            else:
                what[1].tail = None
                parent.append(what[1])


def _title(parts: XmlParts) -> None:
    if "docProps/core.xml" in parts.container.entries:
        for title in parts.tree("docProps/core.xml").getroot().iter(_q(DC, "title")):
            element_text(parts, "docProps/core.xml", title)


def _check_type(container: Container, main: str, what: str) -> None:
    types = container.entries.get("[Content_Types].xml", b"")
    if main not in container.entries or not types:
        raise FileRefused(f"the file is not a {what} file (no {main})", "file_mismatch")


def read_docx(data: bytes, limits: Limits) -> FileDocument:
    container = Container(data, limits)
    _check_type(container, "word/document.xml", ".docx")
    parts = XmlParts(container)
    for name in container.names():
        if DOCX_PARTS.fullmatch(name):
            for p in list(parts.tree(name).getroot().iter(_q(W, "p"))):
                _paragraph(parts, name, _Word, p)
    _title(parts)
    return parts.document(DOCX_TYPE)


def read_pptx(data: bytes, limits: Limits) -> FileDocument:
    container = Container(data, limits)
    _check_type(container, "ppt/presentation.xml", ".pptx")
    parts = XmlParts(container)
    for name in sorted((n for n in container.names() if PPTX_PARTS.fullmatch(n)), key=_slide_order):
        for p in list(parts.tree(name).getroot().iter(_q(A, "p"))):
            _paragraph(parts, name, _Drawing, p)
    _title(parts)
    return parts.document(PPTX_TYPE)


def _slide_order(name: str) -> tuple[str, int]:
    m = re.search(r"(\d+)\.xml$", name)
    return (name.rsplit("/", 1)[0], int(m.group(1)) if m else 0)
