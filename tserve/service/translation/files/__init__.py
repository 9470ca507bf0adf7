"""Files to translate: each format read into blocks of text with markup (`FileDocument`), and written again
from the blocks' rendered translations with everything that is not text as it was. See docs/TRANSLATION.md."""

from __future__ import annotations

import posixpath

from tserve.service.translation.files.containers import FileRefused, Limits
from tserve.service.translation.files.epub import read_epub
from tserve.service.translation.files.markdown import read_markdown
from tserve.service.translation.files.odf import read_odp, read_odt
from tserve.service.translation.files.ooxml import read_docx, read_pptx
from tserve.service.translation.files.text_files import read_html, read_subtitles, read_txt
from tserve.service.translation.files.xml_parts import FileDocument

READERS = {
    ".txt": lambda data, limits: read_txt(data),
    ".md": lambda data, limits: read_markdown(data),
    ".markdown": lambda data, limits: read_markdown(data),
    ".html": lambda data, limits: read_html(data),
    ".htm": lambda data, limits: read_html(data),
    ".srt": lambda data, limits: read_subtitles(data, vtt=False),
    ".vtt": lambda data, limits: read_subtitles(data, vtt=True),
    ".docx": read_docx,
    ".pptx": read_pptx,
    ".odt": read_odt,
    ".odp": read_odp,
    ".epub": read_epub,
}
SUPPORTED = (".txt", ".md", ".html", ".htm", ".docx", ".pptx", ".odt", ".odp", ".srt", ".vtt", ".epub")


def extension(filename: str) -> str:
    return posixpath.splitext(filename.lower())[1]


def read_file(filename: str, data: bytes, limits: Limits) -> FileDocument:
    """The file as blocks to translate; FileRefused names what is wrong (the supported types for a type that is
    not one, or whose content is not what its name says)."""
    reader = READERS.get(extension(filename))
    if reader is None:
        raise FileRefused(f"{filename!r} is not a supported file type (supported: {', '.join(SUPPORTED)})",
                          "unsupported_file")
    try:
        return reader(data, limits)
    except FileRefused as exc:
        if exc.code == "file_mismatch":
            raise FileRefused(f"{filename!r}: {exc} (supported: {', '.join(SUPPORTED)})", exc.code) from exc
        raise


__all__ = ["FileDocument", "FileRefused", "Limits", "SUPPORTED", "extension", "read_file"]
