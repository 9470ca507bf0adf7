"""Unit tests of the pure parsing and splitting functions of training.data (no downloads)."""

from __future__ import annotations

import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from tserve.training import data


# --------------------------------------------------------------------------------------------------
# Cleaning and splitting
# --------------------------------------------------------------------------------------------------
def test_clean_pair_normalises_and_filters():
    assert data.clean_pair("  Open   the&nbsp;file. ", "Datei\u00a0öffnen.") == ("Open the file.", "Datei öffnen.")
    assert data.clean_pair("", "leer") is None
    assert data.clean_pair("x" * 500, "y" * 500) is None  # over max_chars
    assert data.clean_pair("12345", "12345") is None  # no English letters
    assert data.clean_pair("<b>bold</b> text", "fett") is None  # leftover markup
    assert data.clean_pair("Format", "Format") == ("Format", "Format")  # one plain word may be identical
    assert data.clean_pair("print_config_value()", "print_config_value()") is None
    assert data.clean_pair("Yes", "Ja, das ist eine sehr lange und ausschweifende Antwort auf eine kurze Frage") is None


def test_split_by_hash_is_deterministic_disjoint_and_complete():
    items = [f"sentence number {i}" for i in range(2000)]
    a = data.split_by_hash(items, lambda s: s, 0.1, 0.1)
    b = data.split_by_hash(list(reversed(items)), lambda s: s, 0.1, 0.1)
    assert {k: set(v) for k, v in a.items()} == {k: set(v) for k, v in b.items()}
    sets = [set(v) for v in a.values()]
    assert sum(map(len, sets)) == len(items) and set.union(*sets) == set(items)
    assert all(not (x & y) for i, x in enumerate(sets) for y in sets[i + 1 :])
    assert 120 < len(a["valid"]) < 280 and 120 < len(a["test"]) < 280
    # Normalised keys share a split; other items do not move it.
    extra = data.split_by_hash(["Open the file.", "open the file", *items[:10]], lambda s: s, 0.3, 0.3)
    where = {s: k for k, v in extra.items() for s in v}
    assert where["Open the file."] == where["open the file"]
    with pytest.raises(ValueError):
        data.split_by_hash(items, lambda s: s, 0.7, 0.7)


def test_chunk_text_cuts_at_paragraphs():
    paragraphs = [f"Paragraph {i} " + "word " * 30 for i in range(10)]
    text = "\n\n".join(paragraphs)
    chunks = data.chunk_text(text, target_chars=400)
    assert "\n\n".join(chunks) == text
    assert all(len(c) <= 400 + len(paragraphs[0]) for c in chunks) and len(chunks) > 2
    assert data.chunk_text("one paragraph only", 5) == ["one paragraph only"]


def test_read_gutenberg_and_fortunes(tmp_path):
    text = "Header\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nBody line.  \r\n\r\n\r\n\r\nMore.\r\n" \
           "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nLicence"
    assert data.read_gutenberg(text) == "Body line.\n\nMore."
    f = tmp_path / "cookies"
    f.write_text("First cookie.\n%\nSecond\n  -- someone\n%\n%\n")
    assert data.read_fortunes(f) == ["First cookie.", "Second\n  -- someone"]


# --------------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------------
def test_read_mnist_csv_plain_and_gzip():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(3, 784))
    labels = np.array([7, 0, 3])
    text = "\n".join(",".join(str(v) for v in [*row, lab]) for row, lab in zip(pixels, labels, strict=True))
    for blob in (text.encode(), gzip.compress(text.encode())):
        x, y = data.read_mnist_csv(blob)
        assert x.dtype == np.uint8 and x.shape == (3, 28, 28) and (x.reshape(3, -1) == pixels).all()
        assert y.tolist() == [7, 0, 3]
    with pytest.raises(data.DataPreparationError):
        data.read_mnist_csv(b"1,2,3\n")


def test_read_mnist_pickle_merges_train_and_valid():
    rng = np.random.default_rng(1)
    parts = tuple((rng.integers(0, 256, size=(n, 784)).astype(np.float32) / 255, rng.integers(0, 10, n))
                  for n in (5, 2, 3))
    x_bytes = np.rint(parts[0][0] * 255).astype(np.uint8)
    blob = gzip.compress(pickle.dumps(parts, protocol=2))
    out = data.read_mnist_pickle(blob)
    assert out["train"][0].shape == (7, 28, 28) and out["test"][0].shape == (3, 28, 28)
    assert out["train"][0].dtype == np.uint8 and (out["train"][0][:5].reshape(5, -1) == x_bytes).all()
    assert out["train"][1].tolist() == parts[0][1].tolist() + parts[1][1].tolist()


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_read_mnist_pickle_refuses_anything_but_arrays():
    with pytest.raises(data.DataPreparationError, match="refusing"):
        data.read_mnist_pickle(pickle.dumps((_Exploit(),) * 3))
    with pytest.raises(data.DataPreparationError):
        data.read_mnist_pickle(pickle.dumps((1, 2)))


def _idx_bytes(arr: np.ndarray) -> bytes:
    code = {np.dtype("uint8"): 0x08, np.dtype(">i4"): 0x0C}[arr.dtype]
    return bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def test_read_idx(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "a.idx").write_bytes(_idx_bytes(images))
    (tmp_path / "a.idx.gz").write_bytes(gzip.compress(_idx_bytes(images)))
    ints = np.array([1, -2, 300], dtype=">i4")
    (tmp_path / "b.idx").write_bytes(_idx_bytes(ints))
    assert (data.read_idx(tmp_path / "a.idx") == images).all()
    assert (data.read_idx(tmp_path / "a.idx.gz") == images).all()
    assert data.read_idx(tmp_path / "b.idx").tolist() == [1, -2, 300]
    (tmp_path / "bad.idx").write_bytes(_idx_bytes(images)[:-1])
    with pytest.raises(data.DataPreparationError):
        data.read_idx(tmp_path / "bad.idx")


def test_split_images_by_hash_is_stratified_and_deterministic():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(200, 28, 28), dtype=np.uint8)
    y = np.repeat(np.arange(4), 50)
    a = data.split_images_by_hash(x, y, 0.2)
    perm = rng.permutation(200)
    b = data.split_images_by_hash(x[perm], y[perm], 0.2)
    assert np.bincount(a["test"][1]).tolist() == [10, 10, 10, 10]
    key = lambda imgs: sorted(img.tobytes() for img in imgs)  # noqa: E731
    assert key(a["test"][0]) == key(b["test"][0])


# --------------------------------------------------------------------------------------------------
# R serialization
# --------------------------------------------------------------------------------------------------
def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _charsxp(s: str | None) -> bytes:
    if s is None:
        return _i(9) + _i(-1)
    b = s.encode("utf-8")
    return _i(9 | (8 << 12)) + _i(len(b)) + b  # CHARSXP flagged UTF-8


def _strsxp(values: list[str | None], flags: int = 16) -> bytes:
    return _i(flags) + _i(len(values)) + b"".join(_charsxp(v) for v in values)


def test_unserialize_r_strings_named_list_and_gzip():
    header = b"X\n" + _i(2) + _i(0x040000) + _i(0x020300)
    assert data.unserialize_r(header + _strsxp(["Emma", None, "Persuasion – ü"])).value == ["Emma", None, "Persuasion – ü"]
    # list(a = 1:2, b = "x") with a names attribute (VECSXP with the attribute bit).
    names_attr = _i(2 | (1 << 10)) + _i(1) + _charsxp("names") + _strsxp(["a", "b"]) + _i(254)
    body = _i(19 | (1 << 9)) + _i(2) + _i(13) + _i(2) + _i(1) + _i(2) + _strsxp(["x"]) + names_attr
    obj = data.unserialize_r(gzip.compress(header + body))
    assert obj.names() == ["a", "b"]
    assert obj.value[0].value == [1, 2] and obj.value[1].value == ["x"]
    with pytest.raises(data.DataPreparationError):
        data.unserialize_r(b"A\n" + body)


# --------------------------------------------------------------------------------------------------
# Ding dictionary
# --------------------------------------------------------------------------------------------------
DING_SNIPPET = """00-database-info
This is a test.
good morning /ɡʊd ˈmɔːnɪŋ/
guten Morgen
      "Good morning, everybody."  - Guten Morgen zusammen.
      "He said good morning to her/him." - Er wünschte ihr/ihm einen guten Morgen.
Where is the station? /weər ɪz ðə ˈsteɪʃn/
Wo ist der Bahnhof?, Wo ist bitte der Bahnhof?
to be fed up (with sth.) [coll.] /fed ʌp/
etw. satthaben; die Nase voll haben {v} [ugs.]
      "I'm fed up with it!" - Ich habe die Nase voll davon!
"""


def test_parse_ding_snippet(tmp_path):
    f = tmp_path / "test.dict"
    f.write_text(DING_SNIPPET, encoding="utf-8")
    pairs = data.parse_ding(f)
    assert pairs == [
        ("Good morning, everybody.", "Guten Morgen zusammen."),
        ("He said good morning to her.", "Er wünschte ihr einen guten Morgen."),
        ("Where is the station?", "Wo ist der Bahnhof?"),
        ("I'm fed up with it!", "Ich habe die Nase voll davon!"),
    ]
    gz = tmp_path / "test.dict.dz"
    gz.write_bytes(gzip.compress(DING_SNIPPET.encode()))
    assert data.parse_ding(gz) == pairs


# --------------------------------------------------------------------------------------------------
# gettext catalogues
# --------------------------------------------------------------------------------------------------
def _mo_bytes(entries: dict[str, str]) -> bytes:
    """A little-endian GNU .mo file (no hash table), entries sorted by msgid as msgfmt does."""
    keys = sorted(entries)
    ids = [k.encode() for k in keys]
    strs = [entries[k].encode() for k in keys]
    n = len(keys)
    orig_off, trans_off = 28, 28 + 8 * n
    pos = trans_off + 8 * n
    table_o, table_t, blob = b"", b"", b""
    for b in ids:
        table_o += struct.pack("<2I", len(b), pos + len(blob))
        blob += b + b"\0"
    for b in strs:
        table_t += struct.pack("<2I", len(b), pos + len(blob))
        blob += b + b"\0"
    return struct.pack("<7I", 0x950412DE, 0, n, orig_off, trans_off, 0, 0) + table_o + table_t + blob


def test_read_mo_and_parse_mo(tmp_path):
    entries = {
        "": "Content-Type: text/plain; charset=UTF-8\n",
        "~Open File": "Datei ~öffnen",
        "dialog|button\x04_Save As": "Speichern _unter",
        "%1 file\x00%1 files": "%1 Datei\x00%1 Dateien",
        "Untranslated": "",
        "%PRODUCTNAME Help": "%PRODUCTNAME Hilfe",
        "%s": "%s",
    }
    f = tmp_path / "test.mo"
    f.write_bytes(_mo_bytes(entries))
    raw = data.read_mo(f)
    assert (None, "~Open File", "Datei ~öffnen") in raw
    assert ("dialog|button", "_Save As", "Speichern _unter") in raw
    assert (None, "%1 file", "%1 Datei") in raw
    assert len(raw) == len(entries) - 1  # header skipped
    pairs = data.parse_mo(f)
    assert ("Open File", "Datei öffnen") in pairs
    assert ("Save As", "Speichern unter") in pairs
    assert ("LibreOffice Help", "LibreOffice Hilfe") in pairs
    assert all(en != "Untranslated" and en != "%s" for en, _ in pairs)
    (tmp_path / "bad.mo").write_bytes(b"\0" * 32)
    with pytest.raises(data.DataPreparationError):
        data.read_mo(tmp_path / "bad.mo")


def test_extract_help_paragraphs():
    page = ('<html><body><h1 id="hd_id1">Saving <b>Files</b></h1><p id="par_id2">Choose <span class="menu">'
            'File - Save</span>.</p><p>no id</p><span hidden="true" id="other">hidden</span></body></html>')
    assert data.extract_help_paragraphs(page) == [("hd_id1", "Saving Files"), ("par_id2", "Choose File - Save.")]
