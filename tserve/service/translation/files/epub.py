"""EPUB books: every XHTML content document the package lists (chapters, the navigation document) through
the HTML path (tserve/model/html_markup.py: blocks, inline tags placed by alignment, code kept), and the book's
title and the NCX table of contents' labels. Everything else in the container (images, styles, fonts, the
package document's other metadata) comes back byte-identical."""

from __future__ import annotations

import html
import posixpath

from tserve.model.html_markup import Block, Markup, parse_html
from tserve.service.translation.files.containers import Container, FileRefused, Limits, parse_xml, write_xml
from tserve.service.translation.files.text_files import decode_text
from tserve.service.translation.files.xml_parts import FileDocument

EPUB_TYPE = "application/epub+zip"
CONTAINER_NS = "urn:oasis:names:tc:opendocument:xmlns:container"
OPF_NS = "http://www.idpf.org/2007/opf"
NCX_NS = "http://www.daisy.org/z3986/2005/ncx/"
DC = "http://purl.org/dc/elements/1.1/"


def read_epub(data: bytes, limits: Limits) -> FileDocument:
    box = Container(data, limits)
    if box.entries.get("mimetype", b"").strip() != EPUB_TYPE.encode() or "META-INF/container.xml" not in box.entries:
        raise FileRefused("the file is not an .epub file (its mimetype entry says otherwise)", "file_mismatch")
    rootfile = parse_xml(box.entries["META-INF/container.xml"], "META-INF/container.xml").getroot() \
        .find(f".//{{{CONTAINER_NS}}}rootfile")
    opf_name = rootfile.get("full-path") if rootfile is not None else None
    if opf_name not in box.entries:
        raise FileRefused("the .epub names no package document it holds", "file_mismatch")
    opf = parse_xml(box.entries[opf_name], opf_name)
    base = posixpath.dirname(opf_name)
    pages: list[tuple[str, Markup]] = []  # (entry, its markup)
    xml_texts: list[tuple[str, object]] = []  # (entry, element whose text is a title or a label)
    for item in opf.getroot().iter(f"{{{OPF_NS}}}item"):
        name = posixpath.normpath(posixpath.join(base, item.get("href", "")))
        if name not in box.entries:
            continue
        if item.get("media-type") == "application/xhtml+xml":
            markup = parse_html(decode_text(box.entries[name], ".xhtml", utf16=False))
            if markup.blocks:
                pages.append((name, markup))
        elif item.get("media-type") == "application/x-dtbncx+xml":
            ncx = parse_xml(box.entries[name], name)
            xml_texts += [(name, (ncx, e)) for e in ncx.getroot().iter(f"{{{NCX_NS}}}text") if (e.text or "").strip()]
    xml_texts += [(opf_name, (opf, e)) for e in opf.getroot().iter(f"{{{DC}}}title") if (e.text or "").strip()]
    blocks = [b for _, m in pages for b in m.blocks] + [Block("", e.text.strip(), [], "", {}) for _, (_, e) in xml_texts]

    def write(rendered: list[str]) -> bytes:
        replaced: dict[str, bytes] = {}
        at = 0
        for name, markup in pages:
            n = len(markup.blocks)
            replaced[name] = markup.join(rendered[at: at + n]).encode("utf-8")
            at += n
        trees = {}
        for (name, (tree, element)), text in zip(xml_texts, rendered[at:], strict=True):
            element.text = html.unescape(text)  # rendered as HTML; lxml escapes it again
            trees[name] = tree
        for name, tree in trees.items():
            replaced[name] = write_xml(tree, box.entries[name])
        return box.write(replaced)

    return FileDocument(Markup(list(blocks)), None, write, EPUB_TYPE)
