"""A GGUF file's header, read with every count, length, shape and offset it declares checked against the bytes
the file really has before it is used, so that a truncated or lying file is a `CheckpointError` that says what
is wrong, never an allocation of what a count claims, a read past the end or a crash.

Not `gguf.GGUFReader`: it trusts the header, and it makes a numpy view of every element of every array (a
151k-token vocabulary took it 26 s where this walk takes about 1 s). The `gguf` library gives the types, block
sizes and dequantizers (model.gguf.tensors) and writes the tests' files.

The layout (GGUF v2 and v3, little-endian; github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata:  key (string), value type u32, value       string: length u64, UTF-8 bytes
                                                         array: element type u32, count u64, elements
    tensor infos: name (string), n_dims u32, dims u64 x n_dims, ggml type u32, offset u64
    padding to `general.alignment` (32 unless set), then the tensor data, each at its offset from there

The walk reads the header in one pass; the tensor data is not read here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tserve.model.importers.base import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 had 32-bit counts and is no longer written by anyone
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: none of llama.cpp's keys nests deeper than 2
DEFAULT_ALIGNMENT = 32
# The smallest encodings, which bound how many of each a file of n bytes can hold.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, one dimension, type, offset
_SCALARS = {  # value type -> numpy / struct format (little-endian)
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.BOOL: "?", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the innermost (contiguous) dimension first
    kind: GGMLQuantizationType
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]  # key -> int, float, bool, str or a list of them
    tensors: dict[str, TensorInfo]
    data_start: int
    file_size: int


class _Cursor:
    """Reads the header's fields in order, each read first checked against the end of the file."""

    def __init__(self, data: mmap.mmap | bytes, path: Path) -> None:
        self.data, self.pos, self.size, self.path = data, 0, len(data), path

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} at byte {self.pos} needs {n:,} bytes, the file has {self.size - self.pos:,} "
                            f"left (truncated?)")

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.unpack("<Q", f"{what}'s length")
        self.need(length, f"{what} ({length:,} bytes)")
        raw = self.data[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at byte {self.pos - length} is not UTF-8") from exc

    def value(self, kind: int, key: str, depth: int = 0) -> Any:
        """One value of `kind`, each length checked before it is read."""
        if kind in _SCALARS:
            return self._scalar(_SCALARS[GGUFValueType(kind)], key)
        if kind == GGUFValueType.STRING:
            return self.string(f"the value of {key!r}")
        if kind != GGUFValueType.ARRAY:
            raise self.fail(f"metadata {key!r} has value type {kind}, which GGUF does not define")
        if depth >= MAX_NESTING:
            raise self.fail(f"metadata {key!r} nests arrays deeper than {MAX_NESTING}")
        element = self.unpack("<I", f"{key!r}'s element type")
        count = self.unpack("<Q", f"{key!r}'s element count")
        if element in _SCALARS:
            dtype = np.dtype(_SCALARS[GGUFValueType(element)])
            self.need(count * dtype.itemsize, f"{key!r}'s {count:,} elements")
            values = np.frombuffer(self.data, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        # Strings or arrays: each takes at least 8 bytes (a length or a type), so the count is bounded first.
        self.need(count * 8, f"{key!r}'s {count:,} elements")
        return [self.value(element, key, depth + 1) for _ in range(count)]

    def _scalar(self, fmt: str, key: str) -> Any:
        dtype = np.dtype(fmt)
        self.need(dtype.itemsize, f"the value of {key!r}")
        value = np.frombuffer(self.data, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return value


def read_header(path: Path) -> Header:
    """Walk `path`'s header; CheckpointError naming the first field that does not fit the file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise CheckpointError(f"{path}: not a valid GGUF file: {size} bytes, shorter than a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _walk(_Cursor(data, path))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc


def _walk(c: _Cursor) -> Header:
    if bytes(c.data[:4]) != MAGIC:
        raise c.fail(f"it starts with {bytes(c.data[:4])!r}, not the magic {MAGIC!r}")
    c.pos = 4
    version = c.unpack("<I", "the version")
    if version not in VERSIONS:
        raise c.fail(f"GGUF version {version} (readable: {', '.join(map(str, VERSIONS))})")
    n_tensors = c.unpack("<Q", "the tensor count")
    n_kv = c.unpack("<Q", "the metadata count")
    if n_kv > (c.size - c.pos) // _MIN_KV_BYTES:
        raise c.fail(f"{n_kv:,} metadata entries declared, more than a file of {c.size:,} bytes can hold")
    if n_tensors > (c.size - c.pos) // _MIN_TENSOR_INFO_BYTES:
        raise c.fail(f"{n_tensors:,} tensors declared, more than a file of {c.size:,} bytes can hold")
    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        kind = c.unpack("<I", f"{key!r}'s value type")
        metadata[key] = value = c.value(kind, key)
        if key == "general.alignment":
            if kind != GGUFValueType.UINT32 or not value or value & (value - 1):
                raise c.fail(f"general.alignment must be a power of two (u32), got {value}")
            alignment = value
    infos = []
    for i in range(n_tensors):
        name = c.string(f"tensor {i}'s name")
        n_dims = c.unpack("<I", f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        shape = tuple(c.unpack("<Q", f"tensor {name!r}'s dimensions") for _ in range(n_dims))
        kind = c.unpack("<I", f"tensor {name!r}'s type")
        offset = c.unpack("<Q", f"tensor {name!r}'s offset")
        infos.append((name, shape, kind, offset))
    data_start = -(-c.pos // alignment) * alignment
    data_size = c.size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, shape, kind, offset in infos:
        if name in tensors:
            raise c.fail(f"tensor {name!r} appears twice")
        if kind not in GGML_QUANT_SIZES:
            raise c.fail(f"tensor {name!r} has ggml type {kind}, which this gguf library does not know")
        kind = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if shape[0] % block:
            raise c.fail(f"tensor {name!r}: its rows of {shape[0]} are not whole {kind.name} blocks of {block}")
        n_bytes = shape[0] // block * block_bytes
        for dim in shape[1:]:
            n_bytes *= dim  # Python integers: a lying shape gives a huge number here, not an overflow
        if offset % alignment:
            raise c.fail(f"tensor {name!r}'s offset {offset} is not a multiple of the alignment {alignment}")
        if offset + n_bytes > data_size:
            raise c.fail(f"tensor {name!r} ({kind.name}, shape {list(shape)}: {n_bytes:,} bytes at offset "
                         f"{offset:,}) ends past the end of the file's {data_size:,} bytes of data (truncated?)")
        tensors[name] = TensorInfo(name, shape, kind, offset, n_bytes)
    return Header(version, metadata, tensors, data_start, c.size)
