"""LibreOffice: help pages (HTML, paired by paragraph) and gettext .mo catalogues of the interface."""

from __future__ import annotations

import codecs
import logging
import re
import struct
from html.parser import HTMLParser
from pathlib import Path

from tqdm.auto import tqdm

from tserve.training.data.fetch import DataPreparationError
from tserve.training.data.pairs import _letters, normalise_text

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# LibreOffice help pages
# --------------------------------------------------------------------------------------

_HELP_BLOCK_TAGS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "td", "th", "li", "dt", "dd", "caption"}
)
_VOID_TAGS = frozenset(
    {"br", "img", "input", "meta", "link", "hr", "area", "base", "col", "embed", "source", "wbr"}
)


class _HelpTextParser(HTMLParser):
    """Collect the plain text of block elements that carry an ``id``.

    Of the hidden system/application variants of a ``switchinline`` span only the
    ``default…`` one is kept; scripts and styles are skipped.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.items: list[tuple[str, str]] = []
        self._stack: list[tuple[str, bool, list[str] | None, str | None]] = []
        self._skip_depth = 0
        self._open: list[tuple[str, list[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _VOID_TAGS:
            if tag == "br":
                self._text(" ")
            return
        a = dict(attrs)
        el_id = a.get("id") or ""
        skip = tag in ("script", "style") or ("hidden" in a and not el_id.startswith("default"))
        buf: list[str] | None = None
        if tag in _HELP_BLOCK_TAGS:
            self._text(" ")
            if el_id and not self._skip_depth:
                buf = []
                self._open.append((el_id, buf))
        if skip:
            self._skip_depth += 1
        self._stack.append((tag, skip, buf, el_id))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "br":
            self._text(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID_TAGS or not any(t == tag for t, *_ in self._stack):
            return
        while self._stack:
            t, skip, buf, el_id = self._stack.pop()
            if skip:
                self._skip_depth -= 1
            if buf is not None:
                self._open = [(i, b) for i, b in self._open if b is not buf]
                self.items.append((el_id or "", "".join(buf)))
            if t in _HELP_BLOCK_TAGS:
                self._text(" ")
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        self._text(data)

    def _text(self, data: str) -> None:
        if self._skip_depth:
            return
        for _, buf in self._open:
            buf.append(data)

    def close(self) -> None:
        super().close()
        while self._stack:
            self.handle_endtag(self._stack[-1][0])


def extract_help_paragraphs(html_text: str) -> list[tuple[str, str]]:
    """Return ``(id, plain text)`` for each block element with an ``id`` in a help page."""
    parser = _HelpTextParser()
    parser.feed(html_text)
    parser.close()
    out = []
    for el_id, text in parser.items:
        text = normalise_text(text)
        text = re.sub(r"\s+([,.;:!?])(?=\s|$)", r"\1", text)
        out.append((el_id, text))
    return out


def _help_keyed(items: list[tuple[str, str]]) -> dict[tuple[str, int], str]:
    counts: dict[str, int] = {}
    keyed = {}
    for el_id, text in items:
        n = counts.get(el_id, 0)
        counts[el_id] = n + 1
        keyed[(el_id, n)] = text
    return keyed


def parse_libreoffice_help(en_dir: str | Path, de_dir: str | Path) -> list[tuple[str, str]]:
    """Align English and German LibreOffice help pages by relative path and element id.

    ``en_dir``/``de_dir`` are the language roots (``…/help/en-US`` and ``…/help/de``) or any
    matching sub-directories. For each ``*.html`` present in both trees, the block elements
    with the same ``id`` (``par_id…``, ``hd_id…``, …) form a pair; markup is stripped and
    whitespace normalised. Pairs with an empty side are left out; nothing is deduplicated.
    """
    en_dir, de_dir = Path(en_dir), Path(de_dir)
    files = sorted(p.relative_to(en_dir) for p in en_dir.rglob("*.html"))
    pairs: list[tuple[str, str]] = []
    missing = 0
    for rel in tqdm(files, desc="help pages", unit="page", mininterval=5, disable=None):
        de_path = de_dir / rel
        if not de_path.is_file():
            missing += 1
            continue
        en_items = _help_keyed(
            extract_help_paragraphs((en_dir / rel).read_text(encoding="utf-8", errors="replace"))
        )
        de_items = _help_keyed(extract_help_paragraphs(de_path.read_text(encoding="utf-8", errors="replace")))
        for key, en in en_items.items():
            de = de_items.get(key)
            if en and de:
                pairs.append((en, de))
    if missing:
        logger.info("%d English help pages have no German counterpart", missing)
    return pairs


# --------------------------------------------------------------------------------------
# gettext .mo catalogues
# --------------------------------------------------------------------------------------


def read_mo(path: str | Path) -> list[tuple[str | None, str, str]]:
    """Read a GNU gettext ``.mo`` file: a list of ``(context, msgid, msgstr)``.

    Plural entries give their singular forms; the header (empty msgid) is skipped.
    """
    data = Path(path).read_bytes()
    if len(data) < 20:
        raise DataPreparationError(f"{path}: too short for a .mo file")
    magic = struct.unpack("<I", data[:4])[0]
    if magic == 0x950412DE:
        end = "<"
    elif magic == 0xDE120495:
        end = ">"
    else:
        raise DataPreparationError(f"{path}: not a .mo file (magic {magic:#x})")
    _rev, n, orig_off, trans_off = struct.unpack(end + "4I", data[4:20])
    charset = "utf-8"
    out: list[tuple[str | None, str, str]] = []
    for i in range(n):
        try:
            olen, ooff = struct.unpack_from(end + "2I", data, orig_off + 8 * i)
            tlen, toff = struct.unpack_from(end + "2I", data, trans_off + 8 * i)
        except struct.error as exc:  # a table past the file's end
            raise DataPreparationError(f"{path}: truncated .mo file (entry {i} of {n})") from exc
        msgid_b = data[ooff : ooff + olen]
        msgstr_b = data[toff : toff + tlen]
        if len(msgid_b) != olen or len(msgstr_b) != tlen:
            raise DataPreparationError(f"{path}: truncated .mo file (entry {i}'s strings)")
        if not msgid_b:
            header = msgstr_b.decode("utf-8", errors="replace")
            m = re.search(r"charset=([\w-]+)", header)
            if m and _known_codec(m.group(1)):  # a template's placeholder ("CHARSET") names none: UTF-8
                charset = m.group(1)
            continue
        msgid = msgid_b.decode(charset, errors="replace")
        msgstr = msgstr_b.decode(charset, errors="replace")
        ctx = None
        if "\x04" in msgid:
            ctx, msgid = msgid.split("\x04", 1)
        out.append((ctx, msgid.split("\x00")[0], msgstr.split("\x00")[0]))
    return out


def _known_codec(name: str) -> bool:
    try:
        codecs.lookup(name)
    except LookupError:
        return False
    return True


_PLACEHOLDER_RE = re.compile(
    r"%[A-Z][A-Z_0-9]*%?|%\d+|%[-+ #0]*\d*(?:\.\d+)?[sdiufxXcglp]|\$\([A-Za-z_0-9]+\)|\$\d+|\{[\w ]*\}|<[^<>]*>"
)


def _strip_accelerators(text: str, gtk: bool) -> str:
    text = re.sub(r"~(?=\w)", "", text)
    if gtk:
        # GTK .ui strings: ``_`` marks the mnemonic and ``__`` is a literal underscore;
        # placeholders such as ``%FILE_NAME`` or ``$(ARG_1)`` are left alone.
        parts = []
        last = 0
        for m in _PLACEHOLDER_RE.finditer(text):
            parts.append(re.sub(r"(?<!_)_(?!_)", "", text[last : m.start()]).replace("__", "_"))
            parts.append(m.group(0))
            last = m.end()
        parts.append(re.sub(r"(?<!_)_(?!_)", "", text[last:]).replace("__", "_"))
        text = "".join(parts)
    elif (
        text.count("_") == 1
        and re.search(r"_\w", text)
        and not re.search(r"[A-Z]_[A-Z]|\w_\w+_", text)
        and not any("_" in m.group(0) for m in _PLACEHOLDER_RE.finditer(text))
    ):
        text = text.replace("_", "", 1)  # a single mnemonic (``_OK``, ``H_inzufügen``)
    return text


def clean_ui_string(text: str, gtk: bool = False) -> str:
    """Clean a UI string: accelerator markers (``~``, and for GTK ``.ui`` strings the
    mnemonic ``_``), the ``%PRODUCTNAME`` placeholder, escaped newlines and whitespace."""
    text = _strip_accelerators(text, gtk)
    text = text.replace("%PRODUCTNAME", "LibreOffice").replace("\\n", " ")
    return normalise_text(text)


def parse_mo(path: str | Path) -> list[tuple[str, str]]:
    """Return cleaned ``(English msgid, German msgstr)`` UI string pairs from a ``.mo`` file.

    Untranslated entries and entries that are only placeholders/punctuation are skipped;
    accelerator markers are removed (see :func:`clean_ui_string`). Messages whose context
    contains ``|`` come from GTK ``.ui`` files, where a single ``_`` marks the mnemonic.
    """
    pairs = []
    for ctx, msgid, msgstr in read_mo(path):
        if not msgstr.strip():
            continue
        gtk = ctx is not None and "|" in ctx  # contexts of strings from GTK .ui files
        en, de = clean_ui_string(msgid, gtk), clean_ui_string(msgstr, gtk)
        if not re.search(r"[A-Za-z]{2}", _PLACEHOLDER_RE.sub(" ", en)):
            continue
        if _letters(_PLACEHOLDER_RE.sub(" ", de)) == 0:
            continue
        pairs.append((en, de))
    return pairs
