"""Files where their formats meet the text in them and the options of a job: characters that are markup
elsewhere (`&`) in every format, subtitle cues of three lines, Markdown hard breaks inside quotes and lists,
table cells of the same text side by side, the parts of Word and OpenDocument files outside the body (footers,
master pages); and file jobs beside the translation memory (warm, and `cache=false`), `max_tokens`, a pivot
through English and its glossary, and LibreTranslate's `/translate_file` with `source=auto`. The formats are
read and written with tests/files/test_formats.py's stand-in translator (each word upper-cased, aligned to
itself); the jobs run in an app in this process on the committed fixture models, so that the tests take
seconds."""

from __future__ import annotations

import asyncio
import html
import io
import json
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.files.test_formats import MARKED, SENTENCES, upper_case
from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tests.helpers.office_files import FORMATS, build, read_back
from tests.helpers.polling import until
from tests.http.test_pivot_http import pivot_checkpoints

# The jobs' outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


# --------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------
AMPERSANDS = [["fish", "&", "chips"], ["salt", "&", "vinegar"]]
MARKUP_FORMATS = ("html", "vtt", "epub")  # formats whose text is written as HTML: `&` is `&amp;` there


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_ampersand_comes_back_as_the_character_each_format_writes_it_as(fmt):
    """Text is escaped only where the format is markup (HTML, WebVTT, EPUB's pages): a .txt, .srt, Markdown,
    Word, PowerPoint or OpenDocument file holds `&` as the character, so a translation must not write `&amp;`
    into it (read back by each format's own library)."""
    out = upper_case(f"file.{fmt}", build(fmt, AMPERSANDS, {(0, 2)}))
    paragraphs, _ = read_back(fmt, out)
    if fmt in MARKUP_FORMATS:
        assert all("&amp;" in p for p in paragraphs), paragraphs  # escaped once, as the page had it
        paragraphs = [html.unescape(p) for p in paragraphs]
    assert paragraphs == ["FISH & CHIPS", "SALT & VINEGAR"]
    if fmt == "epub":  # the book's title is XML text: lxml escapes it, once
        with zipfile.ZipFile(io.BytesIO(out)) as z:
            opf = z.read("EPUB/content.opf").decode()
        assert "<dc:title>FISH &amp; CHIPS</dc:title>" in opf, opf


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_a_subtitle_cue_of_three_lines_comes_back_in_three(fmt):
    """A cue's lines are read as one text and its translation wrapped again into as many lines as it had: three
    as well as two."""
    cue = "00:00:01,000 --> 00:00:04,000" if fmt == "srt" else "00:01.000 --> 00:04.000"
    src = ("WEBVTT\n\n" if fmt == "vtt" else "") + f"1\n{cue}\nthe quick brown\nfox jumps over\nthe lazy dog\n\n" \
        f"2\n{cue.replace('1', '5', 1)}\nhello world\ngood morning\n"
    assert upper_case(f"a.{fmt}", src.encode()).decode() == src.replace(
        "the quick brown\nfox jumps over\nthe lazy dog", "THE QUICK BROWN\nFOX JUMPS OVER\nTHE LAZY DOG").replace(
        "hello world\ngood morning", "HELLO WORLD\nGOOD MORNING")


def test_a_markdown_hard_break_inside_a_quote_or_a_list_item_keeps_the_line_in_it():
    """A hard break's next line is written with the prefix its container gave it (`> `, the list item's
    indent): without it the line would leave the quote or the list."""
    src = "> the quick brown  \n> fox jumps\n\n- hello world  \n  good morning\n"
    assert upper_case("a.md", src.encode()).decode() == \
        "> THE QUICK BROWN\\\n> FOX JUMPS\n\n- HELLO WORLD\\\n  GOOD MORNING\n"


def test_markdown_table_cells_of_the_same_text_on_one_row_are_each_translated():
    """Cells of one row share a line: each is found after the one before, so two cells of the same text are
    two places, each translated once."""
    src = "| yes | yes | no |\n|---|---|---|\n| no | no | yes |\n"
    assert upper_case("a.md", src.encode()).decode() == src.upper()


def test_a_word_footer_is_translated_like_its_header():
    import docx

    d = docx.Document(io.BytesIO(build("docx", SENTENCES, MARKED)))
    d.sections[0].footer.paragraphs[0].text = "good morning"
    buf = io.BytesIO()
    d.save(buf)
    out = docx.Document(io.BytesIO(upper_case("a.docx", buf.getvalue())))
    assert out.sections[0].footer.paragraphs[0].text == "GOOD MORNING"
    assert out.sections[0].header.paragraphs[0].text == "HELLO WORLD GOOD MORNING"


def test_an_opendocument_master_pages_header_and_footer_are_translated():
    """An .odt's page header and footer live in styles.xml (its master page), not in content.xml."""
    from odf.opendocument import OpenDocumentText
    from odf.style import Footer, Header, MasterPage, PageLayout
    from odf.text import P

    doc = OpenDocumentText()
    layout = PageLayout(name="PL")
    doc.automaticstyles.addElement(layout)
    master = MasterPage(name="Standard", pagelayoutname=layout)
    header, footer = Header(), Footer()
    header.addElement(P(text="good morning"))
    footer.addElement(P(text="hello world"))
    master.addElement(header)
    master.addElement(footer)
    doc.masterstyles.addElement(master)
    doc.text.addElement(P(text="the quick brown fox"))
    buf = io.BytesIO()
    doc.save(buf)
    with zipfile.ZipFile(io.BytesIO(upper_case("a.odt", buf.getvalue()))) as z:
        styles, content = z.read("styles.xml").decode(), z.read("content.xml").decode()
    assert "GOOD MORNING" in styles and "HELLO WORLD" in styles and "good morning" not in styles
    assert "THE QUICK BROWN FOX" in content


# --------------------------------------------------------------------------------------------------
# File jobs
# --------------------------------------------------------------------------------------------------
class FileApp(InProcessApp):
    """An app in this process with its own translation memory and file directory."""

    def __init__(self, root: Path, models: dict[str, Path]) -> None:
        super().__init__(models, gc_freeze=False, file_dir=str(root / "files"),
                         translation_memory=str(root / "memory.sqlite"))

    def job(self, name: str, data: bytes, **fields: str) -> tuple[dict, bytes]:
        """A file job to its end: its last state and the file it made."""
        async def go() -> tuple[dict, bytes]:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
                resp = await c.post("/v1/translations/files", files={"file": (name, data)}, data=fields)
                assert resp.status_code == 202, resp.text
                job_id = resp.json()["id"]
                await until(lambda: self.app.state.file_jobs.jobs[job_id].finished, 60)
                state = (await c.get(f"/v1/translations/jobs/{job_id}")).json()
                assert state["status"] == "succeeded", state
                return state, (await c.get(state["download_url"])).content

        return asyncio.run(go())

    def metric(self, name: str, model: str) -> float:
        return self.app.state.metrics.registry.get_sample_value(name, {"model": model}) or 0.0


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    """English → German, word for word (the lexicon fixture whose alignment heads are known)."""
    root = tmp_path_factory.mktemp("files-mt")
    app = FileApp(root, {"mt": factories.aligned_mt_dir(root / "mt")})
    yield app
    app.stop()


@pytest.fixture(scope="module")
def pivot(tmp_path_factory):
    """German → English and English → "French": de → fr pivots."""
    root = tmp_path_factory.mktemp("files-pivot")
    app = FileApp(root, pivot_checkpoints(root))
    yield app
    app.stop()


def test_a_warm_memory_gives_a_file_the_same_runs_and_cache_false_translates_it_again(mt):
    """A file asked again is answered from the translation memory (no token generated) with the same text
    and runs on the same words; with `cache=false` in the form the engine translates it again."""
    data = build("docx", SENTENCES, MARKED)
    _, first = mt.job("warm.docx", data, model="mt", num_beams="1")
    hits = mt.metric("tserve_translation_memory_hits_total", "mt")
    tokens = mt.metric("tserve_generated_tokens_total", "mt")
    _, warm = mt.job("warm.docx", data, model="mt", num_beams="1")
    assert read_back("docx", warm) == read_back("docx", first)
    assert mt.metric("tserve_translation_memory_hits_total", "mt") > hits
    assert mt.metric("tserve_generated_tokens_total", "mt") == tokens
    hits = mt.metric("tserve_translation_memory_hits_total", "mt")
    _, fresh = mt.job("warm.docx", data, model="mt", num_beams="1", cache="false")
    assert read_back("docx", fresh) == read_back("docx", first)
    assert mt.metric("tserve_translation_memory_hits_total", "mt") == hits  # not looked up
    assert mt.metric("tserve_generated_tokens_total", "mt") > tokens


@pytest.mark.parametrize("fmt", ["txt", "docx"])
def test_a_file_jobs_max_tokens_bounds_each_sentence(mt, fmt):
    """`max_tokens` in a job's form bounds every sentence of the file, as it bounds a text's."""
    data = build(fmt, SENTENCES, MARKED)
    full, _ = read_back(fmt, mt.job(f"a.{fmt}", data, model="mt", num_beams="1")[1])
    short, _ = read_back(fmt, mt.job(f"a.{fmt}", data, model="mt", num_beams="1", max_tokens="2")[1])
    assert full[1] == "Hallo Welt Guten Morgen"
    assert [len(s.split()) for s in short] < [len(f.split()) for f in full]
    assert all(len(s.split()) <= 2 for s in short), short


GERMAN = "der schnelle braune Fuchs.\nGuten Morgen wo ist der Bahnhof.\n"


def test_a_pivoted_file_is_the_second_models_translation_of_the_first_ones(pivot):
    """de → fr through English: the second hop reads the file the first wrote (not the German source), and
    the job names the pair it was asked for and both models."""
    english = pivot.post("/v1/translations", {"model": "de-en", "input": GERMAN}).json()["data"][0]["translation"]
    french = pivot.post("/v1/translations", {"model": "en-fr", "input": english}).json()["data"][0]["translation"]
    state, out = pivot.job("a.txt", GERMAN.encode(), source_lang="de", target_lang="fr")
    assert out.decode() == french
    assert (state["source_lang"], state["target_lang"], state["models"]) == ("de", "fr", ["de-en", "en-fr"])
    assert state["done_segments"] == state["total_segments"] > 0


def test_a_pivoted_files_glossary_term_goes_through_both_hops(pivot):
    """A glossary's source terms are in the file's language and its target terms in the final one: through a
    pivot, the term found in the German goes through English as written and the last hop keeps it, in a file
    as in a text. A source term in the pivot language (English) is not the file's: it places nothing."""
    _, plain = pivot.job("a.txt", GERMAN.encode(), source_lang="de", target_lang="fr")
    _, glossed = pivot.job("a.txt", GERMAN.encode(), source_lang="de", target_lang="fr",
                           glossary=json.dumps({"Fuchs": "Hund"}))
    text = pivot.post("/v1/translations", {"input": GERMAN, "source_lang": "de", "target_lang": "fr",
                                           "glossary": {"Fuchs": "Hund"}}).json()["data"][0]["translation"]
    assert "Hund" not in plain.decode() and "Hund" in glossed.decode()
    assert glossed.decode() == text
    _, english_term = pivot.job("a.txt", GERMAN.encode(), source_lang="de", target_lang="fr",
                                glossary=json.dumps({"fox": "Hund"}))
    assert english_term == plain


def test_libretranslate_detects_an_auto_source_file_and_routes_it_through_the_pivot(pivot):
    """`/translate_file` with `source=auto`: the language is detected from the file's text (German), not taken
    as a code, and the file goes de → en → fr as one asked for by its languages does."""
    async def go() -> bytes:
        transport = httpx.ASGITransport(app=pivot.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            resp = await c.post("/translate_file", files={"file": ("a.txt", GERMAN.encode())},
                                data={"source": "auto", "target": "fr"})
            assert resp.status_code == 200, resp.text
            return (await c.get(resp.json()["translatedFileUrl"])).content

    _, asked = pivot.job("a.txt", GERMAN.encode(), source_lang="de", target_lang="fr")
    assert asyncio.run(go()) == asked
