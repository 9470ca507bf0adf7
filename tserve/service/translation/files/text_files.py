"""Plain text, HTML pages and subtitles (.srt, .vtt).

Text files are UTF-8 (a BOM is kept) or UTF-16 with its byte order mark (written back so); a file with NUL bytes
or a zip's signature is not text. A .txt is one document: sentences, their layout kept byte for byte
(tserve/model/segmentation.py). An .html page goes through the HTML path (tserve/model/html_markup.py). A subtitle
file keeps every line that is not a cue's text as it is (numbers, timings and their settings, WebVTT's header,
NOTE, STYLE and REGION blocks); a cue's lines are read as one text (a sentence often runs over two lines), its
inline tags (<i>, <b>, <v Speaker>) placed like HTML tags, and its translation is wrapped again into as many lines
as the cue had, at the spaces nearest to equal lengths."""

from __future__ import annotations

import html
import re

from tserve.model.html_markup import Block, Markup, parse_html
from tserve.service.translation.files.containers import FileRefused
from tserve.service.translation.files.inline import no_escape
from tserve.service.translation.files.xml_parts import FileDocument

_CUE_SPLIT = re.compile(r"(\r?\n(?:[ \t]*\r?\n)+)")
_TIMING = re.compile(r"^\s*(?:\d+:)?\d{2}:\d{2}[,.]\d{3}\s*-->\s*(?:\d+:)?\d{2}:\d{2}[,.]\d{3}")


_UTF16 = {b"\xff\xfe": "utf-16-le", b"\xfe\xff": "utf-16-be"}  # by their byte order marks


def utf16_of(data: bytes) -> str | None:
    """The UTF-16 a text file is in, by its byte order mark (what Windows writes as "Unicode" text), or None
    (UTF-8; a UTF-32 mark, which starts as UTF-16 little-endian's, is not UTF-16)."""
    if data.startswith(b"\xff\xfe\x00\x00"):
        return None
    return next((name for bom, name in _UTF16.items() if data.startswith(bom)), None)


def decode_text(data: bytes, what: str, utf16: bool = True) -> str:
    """A text file's text: UTF-8 (a BOM dropped), or UTF-16 after its byte order mark (unless `utf16` is false: a
    part of a container, which is written back as UTF-8)."""
    wide = utf16_of(data) if utf16 else None
    if wide is not None:
        try:
            text = data[2:].decode(wide)
        except UnicodeDecodeError as exc:
            raise FileRefused(f"the file is not {wide.upper()} text ({exc})", "file_mismatch") from exc
        if "\x00" in text:
            raise FileRefused(f"the file is not a {what} file (it holds binary data)", "file_mismatch")
        return text
    if data.startswith(b"PK\x03\x04") or b"\x00" in data:
        raise FileRefused(f"the file is not a {what} file (it holds binary data)", "file_mismatch")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FileRefused(f"the file is not UTF-8 text ({exc})", "file_mismatch") from exc


def encoded(text: str, data: bytes) -> bytes:
    """`text` written as the file `data` was: UTF-16 with its byte order mark, or UTF-8 with a BOM where it had one."""
    if (wide := utf16_of(data)) is not None:
        return data[:2] + text.encode(wide)
    return (b"\xef\xbb\xbf" if data.startswith(b"\xef\xbb\xbf") else b"") + text.encode("utf-8")


def charset(media: str, data: bytes) -> str:
    """A text format's media type with the charset the file is written in."""
    return f"{media}; charset={'utf-16' if utf16_of(data) else 'utf-8'}"


def read_txt(data: bytes) -> FileDocument:
    text = decode_text(data, ".txt")
    if not text.strip():
        raise FileRefused("the file holds no text to translate", "empty_input")
    return FileDocument(Markup([Block("", text, [], "", {})]), no_escape,
                        lambda rendered: encoded("".join(rendered), data), charset("text/plain", data))


def read_html(data: bytes) -> FileDocument:
    text = decode_text(data, ".html")
    markup = parse_html(text)
    if not markup.blocks:
        raise FileRefused("the page holds no text to translate", "empty_input")
    return FileDocument(markup, None, lambda rendered: encoded(markup.join(rendered), data),
                        charset("text/html", data))


def rewrap(text: str, lines: int, newline: str) -> str:
    """`text` cut at spaces outside tags into `lines` lines of about equal length."""
    if lines <= 1:
        return text
    spaces, depth = [], 0
    for i, c in enumerate(text):
        depth += c == "<"
        depth -= c == ">" and depth > 0
        if c == " " and not depth:
            spaces.append(i)
    cuts: list[int] = []
    for k in range(1, lines):
        goal = len(text) * k / lines
        free = [s for s in spaces if s not in cuts and (not cuts or s > cuts[-1])]
        if free:
            cuts.append(min(free, key=lambda s: abs(s - goal)))
    out, start = [], 0
    for c in cuts:
        out.append(text[start:c])
        start = c + 1
    return newline.join(out + [text[start:]])


def read_subtitles(data: bytes, vtt: bool) -> FileDocument:
    what = ".vtt" if vtt else ".srt"
    text = decode_text(data, what)
    if vtt and not text.startswith("WEBVTT"):
        raise FileRefused("the file is not a WebVTT file (it does not start with WEBVTT)", "file_mismatch")
    newline = "\r\n" if "\r\n" in text else "\n"
    text = text.replace("\r\n", "\n")
    parts: list[str | Block] = []
    wraps: list[int] = []  # per cue block: its lines
    for chunk in _CUE_SPLIT.split(text):
        lines = chunk.split("\n")
        timing = next((i for i, line in enumerate(lines) if _TIMING.match(line)), None)
        body = lines[timing + 1:] if timing is not None else []
        ending = ""
        while body and not body[-1].strip():
            ending += "\n" + body.pop()
        if _CUE_SPLIT.fullmatch(chunk) or not body:
            parts.append(chunk)
            continue
        parts.append("\n".join(lines[: timing + 1]) + "\n")
        for part in parse_html("\n".join(body)).parts:
            parts.append(part)
            if isinstance(part, Block):
                wraps.append(len(body))
        parts.append(ending)
    if not wraps and not any(_TIMING.match(line) for line in text.split("\n")):
        raise FileRefused(f"the file is not a {what} file (no cue timings in it)", "file_mismatch")
    if not wraps:
        raise FileRefused("the file holds no text to translate", "empty_input")
    markup = Markup([p for p in parts if p != ""])

    def write(rendered: list[str]) -> bytes:
        wrapped = [rewrap(r, n, "\n") for r, n in zip(rendered, wraps, strict=True)]
        return encoded(markup.join(wrapped).replace("\n", newline), data)

    escape = (lambda s: html.escape(s, quote=False)) if vtt else no_escape
    return FileDocument(markup, escape, write, charset("text/vtt", data) if vtt else "application/x-subrip")
