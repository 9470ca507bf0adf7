"""R serialization (RDS / lazy-load databases), enough to read the janeaustenr package's novels."""

from __future__ import annotations

import gzip
import logging
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tserve.training.data.fetch import DataPreparationError

logger = logging.getLogger(__name__)

# ---- R serialization -----------------------------------------------------------------


class RSymbol(str):
    """An R symbol (name)."""


@dataclass
class RObject:
    """A decoded R object: ``rtype`` is the SEXP type number, ``value`` a Python value
    (list for vectors, list of ``(tag, value)`` for pairlists), plus attributes."""

    rtype: int
    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)

    def names(self) -> list[str] | None:
        n = self.attributes.get("names")
        return list(n.value) if isinstance(n, RObject) else None


_NILSXP, _SYMSXP, _LISTSXP, _CLOSXP, _ENVSXP, _PROMSXP, _LANGSXP = 0, 1, 2, 3, 4, 5, 6
_SPECIALSXP, _BUILTINSXP, _CHARSXP, _LGLSXP, _INTSXP, _REALSXP = 7, 8, 9, 10, 13, 14
_CPLXSXP, _STRSXP, _DOTSXP, _VECSXP, _EXPRSXP, _BCODESXP = 15, 16, 17, 19, 20, 21
_EXTPTRSXP, _WEAKREFSXP, _RAWSXP, _S4SXP = 22, 23, 24, 25
_REFSXP, _NILVALUE_SXP, _GLOBALENV_SXP, _UNBOUNDVALUE_SXP, _MISSINGARG_SXP = 255, 254, 253, 252, 251
_BASENAMESPACE_SXP, _NAMESPACESXP, _PACKAGESXP, _PERSISTSXP = 250, 249, 248, 247
_EMPTYENV_SXP, _BASEENV_SXP, _ATTRLANGSXP, _ATTRLISTSXP, _ALTREP_SXP = 242, 241, 240, 239, 238
_NA_INT = -(2**31)


class _RUnserializer:
    """Minimal reader for R's serialization format (XDR, versions 2 and 3)."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            kind = data[:2]
            raise DataPreparationError(f"unsupported R serialization format {kind!r} (only XDR 'X\\n')")
        self.data = data
        self.pos = 2
        self.refs: list[Any] = []
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader R version
        if version == 3:
            n = self.int()
            self.pos += n  # native encoding name
        elif version != 2:
            raise DataPreparationError(f"unsupported R serialization version {version}")

    def int(self) -> int:
        v = struct.unpack_from(">i", self.data, self.pos)[0]
        self.pos += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            upper, lower = self.int(), self.int()
            n = (upper << 32) + (lower & 0xFFFFFFFF)
        return n

    def ints(self, n: int) -> list[int | None]:
        vals = struct.unpack_from(f">{n}i", self.data, self.pos)
        self.pos += 4 * n
        return [None if v == _NA_INT else v for v in vals]

    def doubles(self, n: int) -> list[float]:
        vals = struct.unpack_from(f">{n}d", self.data, self.pos)
        self.pos += 8 * n
        return list(vals)

    def raw(self, n: int) -> bytes:
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def charsxp(self, levels: int) -> str | None:
        n = self.int()
        if n == -1:
            return None
        b = self.raw(n)
        if levels & 4:  # LATIN1
            return b.decode("latin-1")
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b.decode("latin-1")

    def attributes(self) -> dict[str, Any]:
        attr = self.read()
        if isinstance(attr, RObject) and attr.rtype == _LISTSXP:
            return {str(k): v for k, v in attr.value}
        return {}

    def string_vec(self) -> list[str | None]:
        if self.int() != 0:
            raise DataPreparationError("bad R string vector")
        n = self.int()
        return [self._str_item() for _ in range(n)]

    def _str_item(self) -> str | None:
        item = self.read()
        return item if isinstance(item, str) or item is None else str(item)

    def read(self) -> Any:
        flags = self.int()
        t = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        if t == _NILVALUE_SXP:
            return None
        if t in (
            _EMPTYENV_SXP,
            _BASEENV_SXP,
            _GLOBALENV_SXP,
            _UNBOUNDVALUE_SXP,
            _MISSINGARG_SXP,
            _BASENAMESPACE_SXP,
        ):
            return RObject(t, None)
        if t == _REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t == _PERSISTSXP:
            obj = RObject(t, self.string_vec())
            self.refs.append(obj)
            return obj
        if t == _SYMSXP:
            sym = RSymbol(self.read() or "")
            self.refs.append(sym)
            return sym
        if t in (_PACKAGESXP, _NAMESPACESXP):
            obj = RObject(t, self.string_vec())
            self.refs.append(obj)
            return obj
        if t == _ENVSXP:
            env = RObject(t, {})
            self.refs.append(env)
            self.int()  # locked
            enclos, frame, hashtab = self.read(), self.read(), self.read()
            env.attributes = self.attributes()
            env.value = {"enclos": enclos, "frame": frame, "hashtab": hashtab}
            return env
        if t in (_LISTSXP, _LANGSXP, _CLOSXP, _PROMSXP, _DOTSXP, _ATTRLANGSXP, _ATTRLISTSXP):
            return self._pairlist(flags)
        if t in (_EXTPTRSXP, _WEAKREFSXP):
            obj = RObject(t, None)
            self.refs.append(obj)
            if t == _EXTPTRSXP:
                self.read()  # protected
                self.read()  # tag
            if has_attr:
                obj.attributes = self.attributes()
            return obj
        if t in (_SPECIALSXP, _BUILTINSXP):
            n = self.int()
            return RObject(t, self.raw(n).decode("latin-1"))
        if t == _CHARSXP:
            return self.charsxp(levels)
        if t == _ALTREP_SXP:
            return self._altrep()
        if t == _BCODESXP:
            raise DataPreparationError("R byte code objects are not supported")
        obj: RObject
        if t in (_LGLSXP, _INTSXP):
            vals = self.ints(self.length())
            if t == _LGLSXP:
                vals = [None if v is None else bool(v) for v in vals]
            obj = RObject(t, vals)
        elif t == _REALSXP:
            obj = RObject(t, self.doubles(self.length()))
        elif t == _CPLXSXP:
            d = self.doubles(2 * self.length())
            obj = RObject(t, [complex(d[i], d[i + 1]) for i in range(0, len(d), 2)])
        elif t == _STRSXP:
            n = self.length()
            obj = RObject(t, [self._str_item() for _ in range(n)])
        elif t in (_VECSXP, _EXPRSXP):
            n = self.length()
            obj = RObject(t, [self.read() for _ in range(n)])
        elif t == _RAWSXP:
            obj = RObject(t, self.raw(self.length()))
        elif t == _S4SXP:
            obj = RObject(t, None)
        else:
            raise DataPreparationError(f"unsupported R SEXP type {t}")
        if has_attr:
            obj.attributes = self.attributes()
        return obj

    def _pairlist(self, flags: int) -> RObject:
        t = flags & 0xFF
        head = RObject(_LISTSXP if t == _ATTRLISTSXP else (_LANGSXP if t == _ATTRLANGSXP else t), [])
        items: list[tuple[Any, Any]] = head.value
        first = True
        while True:
            has_attr = bool(flags & (1 << 9)) or (flags & 0xFF) in (_ATTRLANGSXP, _ATTRLISTSXP)
            has_tag = bool(flags & (1 << 10))
            attrs = self.attributes() if has_attr else {}
            if first:
                head.attributes = attrs
                first = False
            tag = self.read() if has_tag else None
            car = self.read()
            items.append((tag, car))
            # the cdr: continue iteratively while it is another cons cell of the same kind
            next_flags = struct.unpack_from(">i", self.data, self.pos)[0]
            if (next_flags & 0xFF) == (flags & 0xFF) and (flags & 0xFF) in (_LISTSXP, _ATTRLISTSXP):
                self.pos += 4
                flags = next_flags
                continue
            cdr = self.read()
            if cdr is not None:
                items.append((None, cdr))
            return head

    def _altrep(self) -> Any:
        info = self.read()
        state = self.read()
        attr = self.read()
        cls = str(info.value[0][1]) if isinstance(info, RObject) and info.value else ""
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = (state.value + [0, 0, 0])[:3]
            vals = [start + i * step for i in range(int(n))]
            obj = RObject(
                _INTSXP if cls == "compact_intseq" else _REALSXP,
                [int(v) for v in vals] if cls == "compact_intseq" else vals,
            )
        elif cls == "deferred_string":
            arg = state.value[0][1] if isinstance(state, RObject) and state.rtype == _LISTSXP else state
            obj = RObject(
                _STRSXP,
                [
                    None if v is None else (str(int(v)) if float(v).is_integer() else repr(v))
                    for v in arg.value
                ],
            )
        elif cls.startswith("wrap_"):
            obj = state.value[0]
        else:
            raise DataPreparationError(f"unsupported R ALTREP class {cls!r}")
        if isinstance(attr, RObject) and attr.rtype == _LISTSXP:
            obj.attributes = {str(k): v for k, v in attr.value}
        return obj


def unserialize_r(data: bytes) -> Any:
    """Decode one R object from XDR serialization bytes (gzip-compressed input is accepted)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        return _RUnserializer(data).read()
    except (IndexError, struct.error, UnicodeDecodeError) as exc:  # a reference to nothing read, a cut stream
        raise DataPreparationError(f"malformed R serialization: {exc}") from exc


def _rdb_chunk(rdb: bytes, offset: int, length: int, compressed: int) -> bytes:
    chunk = rdb[offset : offset + length]
    if len(chunk) != length:
        raise DataPreparationError(f"truncated .rdb chunk at {offset}")
    if not compressed:
        return chunk
    n = struct.unpack(">I", chunk[:4])[0]
    body = chunk[4:]
    if compressed in (2, 3):
        kind, body = body[:1], body[1:]
        if kind == b"Z":
            out = zlib.decompress(body)
        elif kind == b"2":
            import bz2

            out = bz2.decompress(body)
        elif kind == b"X":
            import lzma

            out = lzma.decompress(body)
        elif kind == b"0":
            out = body
        else:
            raise DataPreparationError(f"unknown .rdb compression type {kind!r}")
    else:
        out = zlib.decompress(body)
    if len(out) != n:
        raise DataPreparationError(f".rdb chunk at {offset}: expected {n} bytes, got {len(out)}")
    return out


def read_r_rdb(rdb_path: str | Path, rdx_path: str | Path) -> dict[str, list[str]]:
    """Read the character vectors of an R lazy-load database (``.rdb`` + ``.rdx``).

    The ``.rdx`` file is a (compressed) serialized list with ``variables`` (name ->
    ``c(offset, length)`` into the ``.rdb``) and ``compressed``; each ``.rdb`` chunk is a
    4-byte big-endian length followed by compressed R serialization. Returns object name
    -> character vector (``NA`` becomes ``""``); objects of other types are skipped.
    """
    rdx_raw = Path(rdx_path).read_bytes()
    if rdx_raw[:2] == b"\x1f\x8b":
        rdx_raw = gzip.decompress(rdx_raw)
    elif rdx_raw[:2] != b"X\n":
        rdx_raw = zlib.decompress(rdx_raw[4:]) if rdx_raw[4:5] == b"x" else zlib.decompress(rdx_raw)
    index = unserialize_r(rdx_raw)
    if not isinstance(index, RObject) or index.rtype != _VECSXP:
        raise DataPreparationError(f"{rdx_path}: not an R lazy-load index")
    fields = dict(zip(index.names() or [], index.value, strict=False))
    variables = fields.get("variables")
    if not isinstance(variables, RObject):
        raise DataPreparationError(f"{rdx_path}: no 'variables' in the index")
    comp = fields.get("compressed")
    compressed = 1
    if isinstance(comp, RObject) and comp.value:
        v = comp.value[0]
        compressed = int(v) if v is not None else 1
    rdb = Path(rdb_path).read_bytes()
    out: dict[str, list[str]] = {}
    for name, loc in zip(variables.names() or [], variables.value, strict=False):
        offset, length = (int(x) for x in loc.value[:2])
        try:
            obj = unserialize_r(_rdb_chunk(rdb, offset, length, compressed))
        except DataPreparationError as e:  # e.g. byte-compiled functions in a code database
            logger.debug("skipping R object %s: %s", name, e)
            continue
        if isinstance(obj, RObject) and obj.rtype == _STRSXP:
            out[name] = ["" if s is None else s for s in obj.value]
        else:
            logger.debug("skipping R object %s (type %s)", name, getattr(obj, "rtype", type(obj)))
    return out
