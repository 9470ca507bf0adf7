"""OpenDocument text (.odt) and presentation (.odp) files: every paragraph and heading of content.xml
(body, tables, lists, frames and text boxes, slides, speaker notes, footnote bodies) and of styles.xml (the
master pages' headers and footers), and the title in meta.xml.

ODF keeps text as mixed content: `text:span` (a named style) and `text:a` (a link) wrap text and nest; they
become groups and are written again as elements of the same name and attributes around the translated words
aligned to theirs. `text:s` (extra spaces) reads as a space. Tabs and line breaks are pieces the model reads as
a space; notes, frames, bookmarks, fields and annotations are pieces kept whole, moved to where the alignment
puts them."""

from __future__ import annotations

from lxml import etree

from tserve.service.translation.files.containers import Container, FileRefused, Limits
from tserve.service.translation.files.inline import Group, Node, Piece
from tserve.service.translation.files.xml_parts import FileDocument, XmlParts, element_text

TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
DC = "http://purl.org/dc/elements/1.1/"
ODT_TYPE = "application/vnd.oasis.opendocument.text"
ODP_TYPE = "application/vnd.oasis.opendocument.presentation"
PARAGRAPHS = {f"{{{TEXT}}}p", f"{{{TEXT}}}h"}
WRAPPERS = {f"{{{TEXT}}}span", f"{{{TEXT}}}a"}
BREAKS = {f"{{{TEXT}}}tab", f"{{{TEXT}}}line-break"}
SPACES = f"{{{TEXT}}}s"


def _nodes(parent: etree._Element) -> list[Node]:
    out: list[Node] = [parent.text] if parent.text else []
    for child in parent:
        if not isinstance(child.tag, str):  # comments and processing instructions: kept whole
            out.append(Piece(child))
        elif child.tag in WRAPPERS:
            out.append(Group(child, _nodes(child)))
        elif child.tag == SPACES:
            out.append(" ")
        else:
            out.append(Piece(child, breaks=child.tag in BREAKS))
        if child.tail:
            out.append(child.tail)
    return out


def _append_text(parent: etree._Element, text: str) -> None:
    if len(parent):
        parent[-1].tail = (parent[-1].tail or "") + text
    else:
        parent.text = (parent.text or "") + text


def _write(parent: etree._Element, nodes: list[Node]) -> None:
    for n in nodes:
        if isinstance(n, str):
            _append_text(parent, n)
        elif isinstance(n, Group):
            wrapper = etree.SubElement(parent, n.payload.tag, attrib=dict(n.payload.attrib))
            _write(wrapper, n.children)
        else:
            n.payload.tail = None
            parent.append(n.payload)


def _paragraph(parts: XmlParts, part: str, p: etree._Element) -> None:
    def write(rendered: list[Node]) -> None:
        for c in list(p):
            p.remove(c)
        p.text = None
        _write(p, rendered)

    parts.add(part, _nodes(p), write)


def _read(data: bytes, limits: Limits, media_type: str, what: str) -> FileDocument:
    container = Container(data, limits)
    if container.entries.get("mimetype", b"").strip() != media_type.encode() or "content.xml" not in container.entries:
        raise FileRefused(f"the file is not an {what} file (its mimetype entry says otherwise)", "file_mismatch")
    parts = XmlParts(container)
    for name in ("content.xml", "styles.xml"):
        if name in container.entries:
            root = parts.tree(name).getroot()
            for p in list(root.iter(*PARAGRAPHS)):
                _paragraph(parts, name, p)
    if "meta.xml" in container.entries:
        for title in parts.tree("meta.xml").getroot().iter(f"{{{DC}}}title"):
            element_text(parts, "meta.xml", title)
    return parts.document(media_type)


def read_odt(data: bytes, limits: Limits) -> FileDocument:
    return _read(data, limits, ODT_TYPE, ".odt")


def read_odp(data: bytes, limits: Limits) -> FileDocument:
    return _read(data, limits, ODP_TYPE, ".odp")
