"""Two translation features in one request, each compared with the same request made without the other: an
HTML page's and a file's blocks under the request's own beams (greedy, and more beams than the checkpoint's
with as many alternatives), a glossary term under a max_tokens that holds the term and its eos exactly, and a
glossary beside a streamed greedy sentence (its search becomes a beam search, which streams by segment).
Every app runs in this process (`httpx.ASGITransport`) on the committed fixtures, so that the tests take
seconds."""

from __future__ import annotations

import json
import re

import pytest

from tests.engine.test_option_combinations_translation import mt  # noqa: F401 - a module fixture
from tests.files.test_option_combinations_files import FileApp
from tests.helpers import factories
from tests.http.test_html import assert_same_markup

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

# On the tiny translator (a checkpoint of 2 beams) this sentence's greedy translation is not its beams' one.
SENTENCE = "three daughters know the king"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny English → German translator, with a file directory and a translation memory of its own."""
    root = tmp_path_factory.mktemp("pairs-tiny")
    app = FileApp(root, {"mt": factories.tiny_mt_dir(root / "mt")})
    yield app
    app.stop()


def one(app, **body) -> dict:  # noqa: ANN001 - an InProcessApp
    (item,) = app.post("/v1/translations", body).json()["data"]
    return item


def plain(page: str) -> str:
    return re.sub(r"<[^>]+>", "", page)


# ------------------------------------------------------------------------------------------------------------
# Beams beside HTML and files
# ------------------------------------------------------------------------------------------------------------
def test_an_html_pages_and_a_files_blocks_take_the_requests_beams(tiny):
    """An HTML page's blocks and a file's are documents like a text: a greedy request (num_beams 1) decodes them
    greedily, not with the checkpoint's beams, and a text, a page and a file of the same sentence come back the
    same."""
    greedy = one(tiny, input=SENTENCE, num_beams=1, cache=False)["translation"]
    beams = one(tiny, input=SENTENCE, num_beams=2, cache=False)["translation"]
    assert greedy != beams, "greedy and beam translations must differ for this test to tell them apart"
    for num_beams, want in ((1, greedy), (2, beams)):
        page = one(tiny, input=f"<p>{SENTENCE}</p>", format="html", num_beams=num_beams, cache=False)
        assert page["translation"] == f"<p>{want}</p>", num_beams
        _, out = tiny.job("a.txt", f"{SENTENCE}\n".encode(), model="mt", num_beams=str(num_beams),
                          cache="false")
        assert out.decode() == f"{want}\n", num_beams


def test_an_html_page_has_as_many_alternatives_as_its_requests_beams(mt):  # noqa: F811
    """num_beams 4 and n 4 on a checkpoint of 2 beams: the page's sentence is searched with 4 beams, so it has
    the text's 4 alternatives, each in the page's markup."""
    text = "three daughters know the king"
    page = "<p>three daughters <b>know</b> the king</p>"
    want = one(mt, input=text, num_beams=4, n=4, cache=False)["alternatives"]
    assert len(want) == 4
    got = one(mt, input=page, format="html", num_beams=4, n=4, cache=False)["alternatives"]
    assert [plain(a["translation"]) for a in got] == [a["translation"] for a in want]
    for alternative in got:
        assert_same_markup(alternative["translation"], page)


# ------------------------------------------------------------------------------------------------------------
# A glossary beside max_tokens
# ------------------------------------------------------------------------------------------------------------
def test_a_glossary_term_fits_in_max_tokens_of_its_tokens_and_eos(tiny):
    """A term of k tokens fits in max_tokens k + 1 (the term, then eos): the request is translated with the
    term, not refused as terms that cannot fit are (422)."""
    loaded = tiny.registry.models["mt"].loaded
    term = "Hund"
    ids = [t for t in loaded.tokenizer.encode_target(term, add_special_tokens=False) if t != loaded.config.eos_token_id]
    assert len(ids) >= 2
    item = one(tiny, input=SENTENCE, glossary={"king": term}, max_tokens=len(ids) + 1, cache=False)
    assert term in item["translation"]


# ------------------------------------------------------------------------------------------------------------
# A glossary beside a streamed greedy request
# ------------------------------------------------------------------------------------------------------------
def test_a_streamed_greedy_sentence_with_a_glossary_term_streams_as_the_beam_search_it_becomes(tiny):
    """A glossary term raises a greedy sentence's search to 4 beams, which answer once: the stream is the
    segment-by-segment one (a chunk naming its segment), ending with the non-streamed answer."""
    body = {"input": SENTENCE, "num_beams": 1, "glossary": {"king": "Hund"}, "cache": False}
    whole = one(tiny, **body)
    assert "Hund" in whole["translation"]
    text = tiny.post("/v1/translations", body | {"stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert [c["data"][0]["segment"] for c in chunks] == [0]
    assert chunks[-1]["data"][0]["translation"] == whole["translation"] and chunks[-1]["finish_reason"] == "stop"
