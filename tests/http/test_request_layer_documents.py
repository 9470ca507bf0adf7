"""Documents and HTML pages as translation input, between the request and the engine
(`service/engine/translation_input.py`) and back (`service/translation/served.py`): a document of several
sentences beside another input of a batch, a glossary whose term occurs in one sentence of a document or only
inside a longer word, a page whose first block holds several sentences, a page without text, and the usage of a
document whose sentences are several jobs. The app runs in this process (`httpx.ASGITransport`) on the committed
word-for-word translator, so the tests take seconds."""

from __future__ import annotations

import pytest

from tests.engine.test_option_combinations_translation import mt  # noqa: F401 - a module fixture

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

SENTENCE, GERMAN = "three daughters know the king", "drei Töchter weiß der König"
FOX, FUCHS = "the quick brown fox jumps", "der schnelle braune Fuchs springt"
DOCUMENT, TRANSLATED = f"{SENTENCE}\n{FOX}", f"{GERMAN}\n{FUCHS}"  # a line break always ends a sentence


def translator(app):  # noqa: ANN001, ANN201 - the fixture's app, its Translator
    return app.registry.models["mt"].engine.translator


def test_each_input_of_a_batch_gets_its_own_sentences_after_a_document_of_several(mt):  # noqa: F811
    """The engine's results come back numbered across the batch's documents: a document of two sentences
    before a one-sentence input must not shift the second input onto the first document's sentences."""
    body = mt.v1(input=[DOCUMENT, "hello world", SENTENCE], cache=False)
    assert [item["translation"] for item in body["data"]] == [TRANSLATED, "Hallo Welt", GERMAN]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]


def test_a_documents_usage_counts_the_source_tokens_of_every_sentence(mt):  # noqa: F811
    """Usage's prompt tokens are what every job read: a document of two sentences counts both, as the two
    sentences sent as two inputs do."""
    doc = mt.v1(input=DOCUMENT, cache=False)["usage"]
    apart = mt.v1(input=[SENTENCE, FOX], cache=False)["usage"]
    jobs = translator(mt).document(DOCUMENT, None, None).jobs
    assert len(jobs) == 2
    assert doc["prompt_tokens"] == apart["prompt_tokens"] == sum(len(j.source_ids) for j in jobs)
    assert doc["total_tokens"] == doc["prompt_tokens"] + doc["completion_tokens"]


def test_a_glossary_term_constrains_only_the_sentence_it_occurs_in(mt):  # noqa: F811
    """A glossary term is looked for sentence by sentence: the document's other sentence is translated as
    without the glossary, not forced to hold the term too."""
    jobs = translator(mt).document(DOCUMENT, None, None, {"king": "Hund"}).jobs
    assert jobs[0].constraint_terms == ["Hund"]
    assert not jobs[1].constraints and not jobs[1].constraint_terms
    got = mt.one(input=DOCUMENT, glossary={"king": "Hund"}, cache=False)["translation"]
    assert got == f"drei Töchter weiß der Hund\n{FUCHS}"


def test_a_glossary_term_inside_a_longer_word_is_not_placed(mt):  # noqa: F811
    """Terms match whole words only: "now" inside "know" is no occurrence, so the sentence keeps its own
    translation and its job no constraint (nor the four beams a constraint takes)."""
    (job,) = translator(mt).document(SENTENCE, 1, None, {"now": "jetzt"}).jobs
    assert not job.constraints and job.num_beams == 1
    assert mt.one(input=SENTENCE, glossary={"now": "jetzt"}, num_beams=1, cache=False)["translation"] == GERMAN
    # the same term as a whole word is placed
    (job,) = translator(mt).document(f"{SENTENCE} now", 1, None, {"now": "jetzt"}).jobs
    assert job.constraint_terms == ["jetzt"]


def test_a_page_whose_first_block_has_two_sentences_keeps_every_later_block_on_its_own_text(mt):  # noqa: F811
    """A block's sentences are taken from the page's list of sentences by their count: the block after a
    block of two sentences holds its own translation, its link and bold text on their words."""
    first = f"{SENTENCE}. The quick brown fox jumps."  # a page's text runs on: sentences end at a full stop
    page = f"<p>{first}</p>\n<p>hello <b>world</b></p>\n<p><a href=\"#k\">{SENTENCE}</a></p>"
    doc = translator(mt).html_document(page, None, None)
    assert [len(b.segments) for b in doc.blocks] == [2, 1, 1]
    as_text = mt.one(input=first, cache=False)["translation"]  # the same two sentences as a text
    got = mt.one(input=page, format="html", cache=False)["translation"]
    assert got == f"<p>{as_text}</p>\n<p>Hallo <b>Welt</b></p>\n<p><a href=\"#k\">{GERMAN}</a></p>"


@pytest.mark.parametrize("page", ["<p><code>x</code></p>", "<p> </p><br>", "<!-- a comment -->"])
def test_a_page_without_text_is_a_400_naming_the_empty_input(mt, page):  # noqa: F811
    """A page of markup only has nothing to translate: a 400 whose code says the input is empty (not that
    it is too long), naming which input of the batch it is."""
    resp = mt.post("/v1/translations", {"input": ["hello world", page], "format": "html"}, 400)
    error = resp.json()["error"]
    assert error["code"] == "empty_input", error
    assert error["message"].startswith("input 1:"), error
