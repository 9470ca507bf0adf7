"""HTML translation through a real server: the page's tags, attributes, entities, comments and untranslated
elements come back exactly, well-formed; inline tags are placed by the model's own alignment, checked on a
translator whose alignment is known (the lexicon fixture translates word i to word i)."""

from __future__ import annotations

import re
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import LEXICON, assert_greedy_margins
from tests.helpers.server import ServerProcess
from tserve.model.checkpoint import load

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "tserve-en-de"

HELP_PAGE = (
    '<h2>Saving <em>documents</em></h2>\n'
    '<p>Click <b>Save</b> to keep your <a href="save.html?mode=all&amp;ask=no" class="link">changes</a>. '
    'The file is stored in the <i>current <u>folder</u></i>.<br>Press <kbd>Ctrl+S</kbd> to save it again.</p>\n'
    '<!-- keep this comment -->\n'
    '<ul><li>Choose <span translate="no">LibreOffice Calc</span> &amp; open the menu.</li>'
    '<li>Type <code>soffice --help</code> in a terminal.</li></ul>\n'
    '<pre>do not   translate &lt;this&gt;</pre>'
)


class _Tags(HTMLParser):
    """Start tags as written (attributes included), end tags, and whether they nest."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.starts: Counter = Counter()
        self.ends: Counter = Counter()
        self.stack: list[str] = []
        self.nested = True
        self.comments: list[str] = []

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        self.starts[self.get_starttag_text()] += 1
        if tag not in ("br", "img", "hr"):
            self.stack.append(tag)

    def handle_endtag(self, tag):  # noqa: ANN001
        self.ends[tag] += 1
        if not self.stack or self.stack.pop() != tag:
            self.nested = False

    def handle_comment(self, data):  # noqa: ANN001
        self.comments.append(data)


def tags(page: str) -> _Tags:
    t = _Tags()
    t.feed(page)
    t.close()
    return t


def assert_same_markup(out: str, page: str) -> None:
    got, want = tags(out), tags(page)
    assert got.starts == want.starts and got.ends == want.ends, (out, page)
    if want.nested and not want.stack:  # a well-formed page gives a well-formed translation
        assert got.nested and not got.stack, out
    assert got.comments == want.comments


def post(server: ServerProcess, body: dict, status: int = 200) -> dict:
    resp = httpx.post(server.url + "/v1/translations", json={"model": "mt"} | body, timeout=300)
    assert resp.status_code == status, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    srv = ServerProcess(["--model", f"mt={BUNDLED}"], tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def aligned_mt(tmp_path_factory):
    return factories.aligned_mt_dir(tmp_path_factory.mktemp("aligned-mt"))


@pytest.fixture(scope="module")
def lexicon(aligned_mt, tmp_path_factory):
    srv = ServerProcess(["--model", f"mt={aligned_mt}"], tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


def test_a_help_page_keeps_every_tag_attribute_entity_and_untranslated_run(bundled):
    out = post(bundled, {"input": HELP_PAGE, "format": "html"})["data"][0]["translation"]
    assert_same_markup(out, HELP_PAGE)
    for kept in ('<a href="save.html?mode=all&amp;ask=no" class="link">', '<span translate="no">LibreOffice Calc</span>',
                 "<code>soffice --help</code>", "<kbd>Ctrl+S</kbd>", "<pre>do not   translate &lt;this&gt;</pre>",
                 "<!-- keep this comment -->", "&amp;"):
        assert kept in out, (kept, out)
    assert "Click" not in out and "Save" not in re.sub(r"<[^>]+>", "", out)  # the text itself is translated
    # The text between the tags is the model's translation of the page's text.
    plain = post(bundled, {"input": "Click Save to keep your changes."})["data"][0]["translation"]
    first_p = re.search(r"<p>(.*?)(?= The| Die| Der| Das|<br>)", out).group(1)
    assert re.sub(r"<[^>]+>", "", first_p).startswith(plain.split()[0])


def test_alternatives_are_pages_too(bundled):
    page = "<p>Open the <b>File</b> menu and choose <i>Print</i>.</p>"
    item = post(bundled, {"input": page, "format": "html", "n": 3, "num_beams": 4})["data"][0]
    assert item["alternatives"][0]["translation"] == item["translation"]
    assert len({a["translation"] for a in item["alternatives"]}) == len(item["alternatives"]) > 1
    for alt in item["alternatives"]:
        assert_same_markup(alt["translation"], page)


@pytest.mark.parametrize(("words", "span"), [
    ("the quick brown fox jumps", (2, 4)),
    ("hello world good morning", (0, 1)),
    ("where is the station today", (3, 5)),
    ("three small daughters know the king", (1, 3)),
])
def test_a_tag_wraps_exactly_the_translation_of_what_it_wrapped(lexicon, aligned_mt, words, span):
    src = words.split()
    # The fixture's word-for-word translation wins every step by a margin no kernel's rounding can close.
    assert_greedy_margins(load(aligned_mt), words, " ".join(LEXICON[w] for w in src))
    a, b = span
    page = f"<p>{' '.join(src[:a])} <b>{' '.join(src[a:b])}</b> {' '.join(src[b:])}</p>".replace("<p> ", "<p>")
    page = page.replace(" </p>", "</p>")
    out = post(lexicon, {"input": page, "format": "html", "num_beams": 1})["data"][0]["translation"]
    target = [LEXICON[w] for w in src]
    plain = post(lexicon, {"input": words, "num_beams": 1})["data"][0]["translation"]
    assert plain == " ".join(target), "the fixture translates word for word"
    inside = re.search(r"<b>(.*?)</b>", out).group(1)
    assert inside == " ".join(target[a:b]), out
    assert re.sub(r"</?b>", "", out) == f"<p>{' '.join(target)}</p>"


def test_nested_tags_and_a_link_are_placed_on_their_words(lexicon):
    page = '<p>the <a href="/x?a=1&amp;b=2">quick <i>brown</i></a> fox jumps</p>'
    out = post(lexicon, {"input": page, "format": "html", "num_beams": 1})["data"][0]["translation"]
    assert out == '<p>der <a href="/x?a=1&amp;b=2">schnelle <i>braune</i></a> Fuchs springt</p>'


def test_return_alignment_reports_each_segment_and_where_each_tag_went(lexicon):
    page = '<p>the <a href="/x">quick <i>brown</i></a> fox<br>jumps</p>\n<p>hello world</p>'
    item = post(lexicon, {"input": page, "format": "html", "num_beams": 1, "return_alignment": True})["data"][0]
    assert item["translation"] == '<p>der <a href="/x">schnelle <i>braune</i></a> Fuchs<br>springt</p>\n<p>Hallo Welt</p>'
    first, second = item["segments"]
    assert (first["source"], second["source"]) == ("the quick brown fox jumps", "hello world")
    assert first["target_words"] == [LEXICON[w] for w in first["source_words"]]
    assert first["alignment"] == [0, 1, 2, 3, 4] and second["alignment"] == [0, 1]
    assert first["tags"] == [
        {"tag": '<a href="/x">', "kind": "span", "depth": 0, "source_words": [1, 2], "target_words": [1, 2]},
        {"tag": "<i>", "kind": "span", "depth": 1, "source_words": [2], "target_words": [2]},
        {"tag": "<br>", "kind": "atom", "depth": 0, "source_words": [], "target_words": [], "source_boundary": 4,
         "target_boundary": 4}]
    assert second["tags"] == []
    # Text: a segment per sentence (here, per line), no tags; without return_alignment, no segments.
    item = post(lexicon, {"input": "the quick brown fox jumps\nhello world", "num_beams": 1,
                          "return_alignment": True})["data"][0]
    assert [(s["source"], s["translation"], s["alignment"]) for s in item["segments"]] == [
        ("the quick brown fox jumps", "der schnelle braune Fuchs springt", [0, 1, 2, 3, 4]),
        ("hello world", "Hallo Welt", [0, 1])]
    assert all("tags" not in s for s in item["segments"])
    assert "segments" not in post(lexicon, {"input": "good morning"})["data"][0]
    post(lexicon, {"input": "good morning", "return_alignment": True, "stream": True}, 400)


def test_bad_formats_are_400(bundled):
    assert "format" in post(bundled, {"input": "Hello", "format": "xml"}, 400)["error"]["message"]
    post(bundled, {"input": "<p>Hello</p>", "format": "html", "stream": True}, 400)
    post(bundled, {"input": "<p><code>x</code></p>", "format": "html"}, 400)  # nothing to translate
