"""Every file format read into blocks and written again (tserve/service/translation/files/), with a stand-in translator that
upper-cases each word (word i of the translation is word i of the source, so a formatting run must land on
exactly the upper-cased words it covered): the text comes back translated, the runs on their words, the
parts that hold no text byte-identical, and hostile or mislabelled files are refused before anything reads
them. The model's own alignment does the same over HTTP in tests/http/test_files.py."""

from __future__ import annotations

import io
import re
import zipfile

import pytest

from tests.helpers.office_files import FORMATS, build, read_back
from tserve.model.html_markup import render_block, words
from tserve.service.translation.files import FileRefused, Limits, read_file
from tserve.service.translation.files.containers import parse_xml, write_xml

SENTENCES = [["the", "quick", "brown", "fox", "jumps"], ["hello", "world", "good", "morning"]]
MARKED = {(0, 2), (0, 3), (1, 1)}
TRANSLATED_PARTS = {  # the entries a translation rewrites; every other one must come back byte-identical
    "docx": {"word/document.xml", "word/header1.xml", "docProps/core.xml"},
    "pptx": {"ppt/slides/slide1.xml", "ppt/notesSlides/notesSlide1.xml"},
    "odt": {"content.xml"},
    "odp": {"content.xml"},
    "epub": {"EPUB/one.xhtml", "EPUB/nav.xhtml", "EPUB/toc.ncx", "EPUB/content.opf"},
}


def upper_case(name: str, data: bytes, limits: Limits | None = None) -> bytes:
    """The file 'translated' by upper-casing every word, each aligned to itself."""
    doc = read_file(name, data, limits or Limits())
    rendered = []
    for block in doc.markup.blocks:
        target = block.text.upper()
        source_words = words(block.text)
        rendered.append(render_block(block, target, words(target), source_words, list(range(len(source_words))),
                                     doc.escape))
    return doc.write(rendered)


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_is_translated_and_each_run_stays_on_its_words(fmt):
    data = build(fmt, SENTENCES, MARKED)
    assert read_back(fmt, data)[0] == [" ".join(s) for s in SENTENCES]
    paragraphs, marked = read_back(fmt, upper_case(f"file.{fmt}", data))
    assert paragraphs == [" ".join(s).upper() for s in SENTENCES]
    if fmt != "txt":
        assert marked == ["BROWN FOX", "WORLD"]


# Two kinds of formatting on adjacent words (bold then italics; italics then bold), each run on its own words.
SIDE_BY_SIDE = {(0, 1): "a", (0, 2): "b", (1, 0): "b", (1, 1): "a"}


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "txt"])
def test_two_kinds_of_formatting_side_by_side_each_stay_on_their_words(fmt):
    def stretches(data: bytes, kind: str) -> list[str]:
        return [t.strip() for t in read_back(fmt, data, kind)[1]]

    data = build(fmt, SENTENCES, SIDE_BY_SIDE)
    assert stretches(data, "a") == ["quick", "world"] and stretches(data, "b") == ["brown", "hello"]
    out = upper_case(f"file.{fmt}", data)
    assert read_back(fmt, out)[0] == [" ".join(s).upper() for s in SENTENCES]
    assert stretches(out, "a") == ["QUICK", "WORLD"]
    assert stretches(out, "b") == ["BROWN", "HELLO"]

@pytest.mark.parametrize("fmt", sorted(TRANSLATED_PARTS))
def test_parts_without_text_come_back_byte_identical(fmt):
    data = build(fmt, SENTENCES, MARKED)
    out = upper_case(f"file.{fmt}", data)
    with zipfile.ZipFile(io.BytesIO(data)) as before, zipfile.ZipFile(io.BytesIO(out)) as after:
        assert before.namelist() == after.namelist()
        assert [i.compress_type for i in before.infolist()] == [i.compress_type for i in after.infolist()]
        changed = {n for n in before.namelist() if before.read(n) != after.read(n)}
        images = [n for n in before.namelist() if n.endswith((".png", ".jpeg"))]
    assert images, "the fixture holds an image"
    assert changed == TRANSLATED_PARTS[fmt] & set(before.namelist())


def test_word_headers_tables_and_title_are_translated():
    import docx

    d = docx.Document(io.BytesIO(upper_case("a.docx", build("docx", SENTENCES, MARKED))))
    assert d.sections[0].header.paragraphs[0].text == "HELLO WORLD GOOD MORNING"
    assert d.tables[0].cell(0, 0).text == "THE QUICK BROWN FOX JUMPS"
    assert d.core_properties.title == "THE QUICK BROWN FOX JUMPS"


def test_slide_titles_and_notes_are_translated():
    from pptx import Presentation

    slide = Presentation(io.BytesIO(upper_case("a.pptx", build("pptx", SENTENCES, MARKED)))).slides[0]
    assert slide.shapes.title.text == "THE QUICK BROWN FOX JUMPS"
    assert slide.notes_slide.notes_text_frame.text == "HELLO WORLD GOOD MORNING"


def test_a_book_title_and_table_of_contents_are_translated():
    out = upper_case("a.epub", build("epub", SENTENCES, MARKED))
    with zipfile.ZipFile(io.BytesIO(out)) as z:
        assert "<dc:title>THE QUICK BROWN FOX JUMPS</dc:title>" in z.read("EPUB/content.opf").decode()
        assert "<text>ONE</text>" in z.read("EPUB/toc.ncx").decode()


def test_markdown_keeps_code_links_and_layout():
    src = ("# the *quick* fox\n\nhello `code()` and [world](http://x.org/a_b \"t\") here  \nnext line\n\n"
           "> quoted *text*\n> goes on\n\n- one\n- two\n\n| a | b |\n|---|---|\n| good | morning |\n\n"
           "```py\nkeep = 1\n```\n\n    indented code\n")
    out = upper_case("a.md", src.encode()).decode()
    assert out == ("# THE *QUICK* FOX\n\nHELLO `code()` AND [WORLD](http://x.org/a_b \"t\") HERE\\\nNEXT LINE\n\n"
                   "> QUOTED *TEXT* GOES ON\n\n- ONE\n- TWO\n\n| A | B |\n|---|---|\n| GOOD | MORNING |\n\n"
                   "```py\nkeep = 1\n```\n\n    indented code\n")


def test_subtitles_keep_numbers_timings_settings_and_line_count():
    srt = ("1\r\n00:00:01,000 --> 00:00:02,500\r\nthe quick brown\r\nfox jumps\r\n\r\n"
           "2\r\n00:00:03,000 --> 00:00:04,000\r\nhello world\r\n")
    assert upper_case("a.srt", srt.encode()).decode() == srt.upper().replace("-->", "-->")
    vtt = ("WEBVTT - a header\n\nSTYLE\n::cue { color: red }\n\nNOTE not translated\n\nintro\n"
           "00:01.000 --> 00:02.000 line:0 position:20%\n<v Anna>good morning</v> &amp; hello\n")
    assert upper_case("a.vtt", vtt.encode()).decode() == vtt.replace(
        "<v Anna>good morning</v> &amp; hello", "<v Anna>GOOD MORNING</v> &amp; HELLO")


def test_text_keeps_its_layout_and_byte_order_mark():
    src = "\ufeff  the quick fox.\n\n\thello world\r\n"
    assert upper_case("a.txt", src.encode("utf-8")) == "\ufeff  THE QUICK FOX.\n\n\tHELLO WORLD\r\n".encode("utf-8")


# --------------------------------------------------------------------------------------------------
# Hostile and mislabelled files
# --------------------------------------------------------------------------------------------------
def _zip(entries: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as z:
        for name, body in entries.items():
            z.writestr(name, body)
    return out.getvalue()


def _docx_with(extra: dict[str, bytes]) -> bytes:
    with zipfile.ZipFile(io.BytesIO(build("docx", SENTENCES, MARKED))) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    return _zip(entries | extra)


def refused(name: str, data: bytes, code: str, limits: Limits | None = None) -> str:
    with pytest.raises(FileRefused) as exc:
        read_file(name, data, limits or Limits())
    assert exc.value.code == code, exc.value
    return str(exc.value)


def test_a_zip_bomb_is_refused_from_its_directory_before_it_is_unpacked():
    bomb = _docx_with({"word/media/zeros.bin": bytes(8 * 2**20)})
    assert len(bomb) < 100_000  # 8 MiB of zeros pack small
    message = refused("bomb.docx", bomb, "hostile_file", Limits(max_unzipped_bytes=4 * 2**20))
    assert "unpacks to" in message
    upper_case("bomb.docx", bomb, Limits(max_unzipped_bytes=16 * 2**20))  # the same file under a higher limit


def test_too_many_entries_are_refused():
    crowded = _docx_with({f"customXml/item{i}.xml": b"<a/>" for i in range(40)})
    assert "entries" in refused("many.docx", crowded, "hostile_file", Limits(max_entries=30))


def test_an_entry_that_unpacks_to_more_than_it_declares_is_refused():
    honest = _docx_with({"word/media/zeros.bin": bytes(100_000)})
    # The central directory's uncompressed size of that entry, rewritten to 1000 (a directory that lies).
    at = honest.rindex(b"word/media/zeros.bin") - 46
    assert honest[at: at + 4] == b"PK\x01\x02"
    lying = honest[: at + 24] + (1000).to_bytes(4, "little") + honest[at + 28:]
    assert "does not unpack to what the archive declares" in refused("lying.docx", lying, "hostile_file")


@pytest.mark.parametrize("name", ["../evil.xml", "/etc/evil.xml", "word\\..\\..\\evil.xml", "C:/evil.xml"])
def test_entry_names_that_climb_out_are_refused(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "entry named" in refused("slip.docx", _docx_with({name: b"<x/>"}), "hostile_file")
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "evil.xml").exists()


def test_xml_entity_declarations_are_refused():
    laughs = (b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;">]>'
              b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p>'
              b"<w:r><w:t>&b;</w:t></w:r></w:p></w:body></w:document>")
    assert "entities" in refused("laughs.docx", _docx_with({"word/document.xml": laughs}), "hostile_file")
    external = laughs.replace(b'<!ENTITY a "aaaaaaaaaa">', b'<!ENTITY a SYSTEM "file:///etc/passwd">')
    refused("external.docx", _docx_with({"word/document.xml": external}), "hostile_file")
    for encoding in ("utf-16", "utf-32"):  # the declarations' bytes are not b"<!ENTITY" there
        wide = laughs.decode().replace('encoding="UTF-8"', "").replace('version="1.0"',
                                                                       f'version="1.0" encoding="{encoding}"')
        refused(f"{encoding}.docx", _docx_with({"word/document.xml": wide.encode(encoding)}), "hostile_file")


@pytest.mark.parametrize(("name", "data"), [
    ("report.docx", b"just some text, not a zip"),
    ("report.docx", build("odt", SENTENCES, MARKED)),
    ("slides.pptx", build("docx", SENTENCES, MARKED)),
    ("book.epub", build("docx", SENTENCES, MARKED)),
    ("notes.txt", build("docx", SENTENCES, MARKED)),
    ("notes.md", b"\x00\x01\x02binary"),
    ("page.html", "caf\u00e9".encode("latin-1")),
    ("film.srt", b"no cues in here\n"),
    ("film.vtt", b"1\n00:00:01,000 --> 00:00:02,000\nnot WebVTT\n"),
])
def test_content_that_is_not_what_the_name_says_is_refused_naming_the_types(name, data):
    message = refused(name, data, "file_mismatch")
    assert ".docx" in message and ".epub" in message and ".srt" in message


def test_an_unsupported_type_is_refused_naming_the_types():
    assert ".odp" in refused("scan.pdf", b"%PDF-1.7", "unsupported_file")


W_NS = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def test_footnotes_and_text_boxes_are_translated_and_the_box_stays_in_its_paragraph():
    footnotes = (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:footnotes {W_NS}>'
                 '<w:footnote w:id="1"><w:p><w:r><w:t>good morning</w:t></w:r></w:p></w:footnote></w:footnotes>')
    body = (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document {W_NS}><w:body>'
            '<w:p><w:r><w:t xml:space="preserve">hello </w:t></w:r>'
            '<w:r><w:drawing><w:txbxContent><w:p><w:r><w:t>the fox</w:t></w:r></w:p></w:txbxContent></w:drawing></w:r>'
            '<w:r><w:t xml:space="preserve"> world</w:t></w:r>'
            '<w:r><w:footnoteReference w:id="1"/></w:r></w:p></w:body></w:document>')
    data = _docx_with({"word/document.xml": body.encode(), "word/footnotes.xml": footnotes.encode()})
    with zipfile.ZipFile(io.BytesIO(upper_case("notes.docx", data))) as z:
        document, notes = z.read("word/document.xml").decode(), z.read("word/footnotes.xml").decode()
    assert "<w:t>GOOD MORNING</w:t>" in notes
    assert "<w:t>THE FOX</w:t></w:r></w:p></w:txbxContent></w:drawing>" in document
    texts = re.findall(r"<w:t[^>]*>([^<]*)</w:t>", document)
    assert texts == ["HELLO ", "THE FOX", " WORLD"] or texts == ["HELLO", "THE FOX", " WORLD"], texts
    assert document.index("THE FOX") < document.index("WORLD") < document.index("footnoteReference")


def test_markdown_inline_html_pairs_autolinks_and_a_code_span_glued_to_a_word():
    src = "write <b>bold words</b> to <x@y.org> or <http://x.org/a> now<br> and g`y` then\n"
    # an e-mail autolink is written back as it was (markdown-it reads it as mailto:); the space after a code
    # span glued to the word before stays after it
    assert upper_case("a.md", src.encode()).decode() == \
        "WRITE <b>BOLD WORDS</b> TO <x@y.org> OR <http://x.org/a> NOW<br> AND G`y` THEN\n"


def test_an_xml_part_keeps_the_declaration_it_had():
    def written(original: bytes) -> bytes:
        return write_xml(parse_xml(original, "part.xml"), original)

    assert written(b"<a><b>x</b></a>") == b"<a><b>x</b></a>"
    assert written(b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<a/>') == \
        b"<?xml version='1.0' encoding='UTF-8' standalone='yes'?>\n<a/>"
    assert written(b"<?xml version='1.0' standalone='yes'?><a/>").startswith(b"<?xml version='1.0' encoding='UTF-8' standalone='yes'?>")
    assert written(b'<?xml version="1.0"?><a/>') == b"<?xml version='1.0' encoding='UTF-8'?>\n<a/>"


def test_refusals_say_what_is_wrong_with_the_file():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z, pytest.warns(UserWarning, match="Duplicate name"):
        z.writestr("word/document.xml", b"<a/>")
        z.writestr("word/document.xml", b"<b/>")
    assert "entry named 'word/document.xml'" in refused("twice.docx", out.getvalue(), "hostile_file")
    assert "word/document.xml is not well-formed XML" in refused(
        "broken.docx", _docx_with({"word/document.xml": b"<w:document"}), "file_mismatch")
    assert "the file is not an .odp file" in refused("slides.odp", build("odt", SENTENCES, MARKED), "file_mismatch")
    assert "the file is not UTF-8 text" in refused("notes.txt", b"caf\xe9", "file_mismatch")
    with zipfile.ZipFile(io.BytesIO(build("epub", SENTENCES, MARKED))) as z:
        book = {n: z.read(n) for n in z.namelist()}
    book["META-INF/container.xml"] = book["META-INF/container.xml"].replace(b"full-path=\"", b"full-path=\"gone/")
    assert "the .epub names no package document it holds" in refused("book.epub", _zip(book), "file_mismatch")
    for name in ("blank.txt", "blank.md"):
        assert refused(name, b" \n\n ", "empty_input").startswith("the file holds no text to translate")
    assert read_file("a.txt", b"hello", Limits()).media_type == "text/plain; charset=utf-8"


def test_a_word_field_is_kept_whole_and_the_text_after_it_is_translated():
    field = ('<w:r><w:fldChar w:fldCharType="begin"/></w:r><w:r><w:instrText xml:space="preserve"> PAGE </w:instrText>'
             '</w:r><w:r><w:fldChar w:fldCharType="separate"/></w:r><w:r><w:t>page one</w:t></w:r>'
             '<w:r><w:fldChar w:fldCharType="end"/></w:r>')
    body = (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document {W_NS}><w:body>'
            f'<w:p><w:r><w:t xml:space="preserve">see </w:t></w:r>{field}'
            '<w:r><w:t xml:space="preserve"> for more words</w:t></w:r></w:p></w:body></w:document>')
    out = upper_case("field.docx", _docx_with({"word/document.xml": body.encode()}))
    with zipfile.ZipFile(io.BytesIO(out)) as z:
        document = z.read("word/document.xml").decode()
    runs = re.findall(r"<w:r>(?:(?!</w:r>).)*</w:r>", field)
    at = [document.index(run) for run in runs]  # each of the field's runs kept as it was, in order
    assert at == sorted(at) and "PAGE ONE" not in document  # its result is the application's to compute
    assert document.index("SEE") < at[0] and at[-1] < document.index(" FOR MORE WORDS</w:t>")
