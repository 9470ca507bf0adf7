"""What a user's file may be before anything reads it: zip containers and XML parts treated as hostile.

A zip container (.docx, .pptx, .odt, .odp, .epub) is checked from its central directory before any entry is
read: at most `max_entries` entries, declared sizes summing to at most `max_unzipped_bytes`, and no entry name
that is absolute, climbs out (`..`), uses backslashes or repeats. Entries are then read into memory only,
each stopped at the size it declared and checked against its CRC (a directory that lies about sizes fails),
so nothing from an archive is ever written to disk under the name it gives. XML parts are parsed by lxml with entity
resolution, DTD loading and the network off, and a part that declares entities (`<!ENTITY`: the billion
laughs, external entities) is refused before it is parsed."""

from __future__ import annotations

import io
import posixpath
import zipfile
import zlib
from dataclasses import dataclass

from lxml import etree


class FileRefused(ValueError):
    """The file cannot be taken: `code` says why (unsupported_file, file_mismatch, hostile_file)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    max_unzipped_bytes: int = 256 * 2**20
    max_entries: int = 4096


def unsafe_entry_name(name: str) -> bool:
    """Absolute, with a drive letter, climbing out of the archive, or with backslashes (read as separators by
    some tools)."""
    return (name.startswith("/") or "\\" in name or ".." in name.split("/") or (len(name) > 1 and name[1] == ":")
            or posixpath.normpath(name).startswith(".."))


class Container:
    """A zip container's entries, in their order, read into memory; `write` builds it again with some entries
    replaced and every other one byte-identical (same name, order, date, compression)."""

    def __init__(self, data: bytes, limits: Limits) -> None:
        try:
            archive = zipfile.ZipFile(io.BytesIO(data))
        except (zipfile.BadZipFile, ValueError) as exc:
            raise FileRefused(f"not a zip container ({exc})", "file_mismatch") from exc
        infos = archive.infolist()
        if len(infos) > limits.max_entries:
            raise FileRefused(f"the archive has {len(infos)} entries; at most {limits.max_entries} are taken",
                              "hostile_file")
        declared = sum(i.file_size for i in infos)
        if declared > limits.max_unzipped_bytes:
            raise FileRefused(f"the archive unpacks to {declared} bytes; at most {limits.max_unzipped_bytes} "
                              "are taken", "hostile_file")
        seen: set[str] = set()
        for info in infos:
            name = info.filename
            if unsafe_entry_name(name) or name in seen:
                raise FileRefused(f"the archive holds an entry named {name!r}, which is refused", "hostile_file")
            seen.add(name)
        self.infos = infos
        self.entries: dict[str, bytes] = {}
        for info in infos:
            if info.is_dir():
                self.entries[info.filename] = b""
                continue
            try:  # zipfile stops at the declared size and checks the CRC there: a lying directory fails it
                with archive.open(info) as f:
                    body = f.read(info.file_size + 1)
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                raise FileRefused(f"the entry {info.filename!r} does not unpack to what the archive declares "
                                  f"({exc})", "hostile_file") from exc
            if len(body) != info.file_size:
                raise FileRefused(f"the entry {info.filename!r} does not unpack to what the archive declares",
                                  "hostile_file")
            self.entries[info.filename] = body

    def names(self) -> list[str]:
        return [i.filename for i in self.infos]

    def write(self, replaced: dict[str, bytes]) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as archive:
            for info in self.infos:
                archive.writestr(info, replaced.get(info.filename, self.entries[info.filename]),
                                 compress_type=info.compress_type)
        return out.getvalue()


_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False,
                          remove_blank_text=False)


def parse_xml(data: bytes, name: str) -> etree._ElementTree:
    """A part's tree; FileRefused where it declares entities (looked for in the bytes before parsing, and in the
    parsed document type, which a part in UTF-16 or UTF-32 hides from the first look; the parser expands none)."""
    refused = FileRefused(f"{name} declares XML entities, which are refused", "hostile_file")
    if b"<!ENTITY" in data:
        raise refused
    try:
        tree = etree.ElementTree(etree.fromstring(data, _PARSER))
    except etree.XMLSyntaxError as exc:
        raise FileRefused(f"{name} is not well-formed XML ({exc})", "file_mismatch") from exc
    dtd = tree.docinfo.internalDTD
    if dtd is not None and next(iter(dtd.iterentities()), None) is not None:
        raise refused
    return tree


def write_xml(tree: etree._ElementTree, original: bytes) -> bytes:
    """The tree with the declaration the part had (standalone kept)."""
    if not original.lstrip().startswith(b"<?xml"):
        return etree.tostring(tree.getroot(), encoding="UTF-8")
    standalone = b'standalone="yes"' in original[:200] or b"standalone='yes'" in original[:200]
    return etree.tostring(tree, xml_declaration=True, encoding="UTF-8", standalone=True if standalone else None)
