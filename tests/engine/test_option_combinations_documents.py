"""Documents and markup where they meet other options: sentence ends beside quotes and numbers, HTML blocks
written over several lines, elements kept untranslated however the page writes them (nested, single-quoted,
scripts), a sentence of exactly the source limit, a glossary whose terms share a target or fall where a long
sentence is cut, and the translation memory shared in a process under another bound. The app runs in this
process (`httpx.ASGITransport`) on the committed word-for-word translator, so the tests take seconds."""

from __future__ import annotations

import pytest

from tests.engine.test_option_combinations_translation import mt  # noqa: F401 - a module fixture
from tests.http.test_html import assert_same_markup
from tserve.model.html_markup import parse_html
from tserve.model.segmentation import split_sentences
from tserve.service.engine.translation_input import Translator
from tserve.service.translation.memory import StoredHypothesis, shared_memory

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

SENTENCE = "three daughters know the king"
GERMAN = "drei Töchter weiß der König"


# ------------------------------------------------------------------------------------------------------------
# Sentence ends beside quotes, brackets and numbers
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opening", ['"', "(", '("', "“", "«"])
def test_an_abbreviation_after_an_opening_quote_or_bracket_does_not_end_the_sentence(opening):
    """`Dr.` is an abbreviation also where a quote or a bracket opens right before it: the sentence goes on, as
    it does for the bare word."""
    closing = {'"': '"', "(": ")", '("': '")', "“": "”", "«": "»"}[opening]
    text = f"He met {opening}Dr. Smith{closing} there. Then he left."
    assert split_sentences(text).segments == [f"He met {opening}Dr. Smith{closing} there.", "Then he left."]
    bare = "He met Dr. Smith there. Then he left."
    assert split_sentences(bare).segments == ["He met Dr. Smith there.", "Then he left."]


@pytest.mark.parametrize("number", ["1000", "1,000", "12,500,000"])
def test_a_number_before_a_full_stop_is_a_number_with_or_without_thousands_separators(number):
    """A number before a full stop does not end the sentence (`No. 5`, `5. Mai`), whether its thousands are
    written with commas or not: 1,000 reads as 1000 does."""
    doc = split_sentences(f"It cost {number}. Then more. Done here.")
    assert doc.segments == [f"It cost {number}. Then more.", "Done here."]


# ------------------------------------------------------------------------------------------------------------
# HTML blocks written over several lines, and elements kept untranslated
# ------------------------------------------------------------------------------------------------------------
def test_a_block_written_over_several_lines_keeps_its_line_breaks_and_indentation(mt):  # noqa: F811
    """A hand-written page puts a block's text on its own indented line: the line breaks and the indentation
    inside the block tags stay where they were, around the translated text."""
    page = f"<ul>\n  <li>\n    {SENTENCE}\n  </li>\n</ul>\n<p>\n\t{SENTENCE} </p>"
    block = parse_html(page).blocks[0]
    assert (block.lead, block.text, block.trail) == ("\n    ", SENTENCE, "\n  ")
    got = mt.one(input=page, format="html", cache=False)["translation"]
    assert got == f"<ul>\n  <li>\n    {GERMAN}\n  </li>\n</ul>\n<p>\n\t{GERMAN} </p>"
    assert_same_markup(got, page)


@pytest.mark.parametrize("kept", [
    '<span translate="no">Calc <span class="v">7.2</span> Pro</span>',
    "<code>a <code>b</code> c</code>",
    "<span translate='no'>Calc Pro</span>",
    "<span translate=no>Calc Pro</span>",
    "<script>var king = 'the king';</script>",
    "<style>b { color: red }</style>",
])
def test_an_element_kept_untranslated_is_kept_whole_however_the_page_writes_it(kept, mt):  # noqa: F811
    """translate="no" in any quoting, an untranslated element holding another of its own tag, a script or a
    style: the whole element comes back verbatim and none of its text reaches the model, whose text is the
    block's words around it."""
    page = f"<p>three daughters {kept} know the king</p>"
    (block,) = parse_html(page).blocks
    assert block.text == SENTENCE
    got = mt.one(input=page, format="html", cache=False)["translation"]
    assert kept in got
    assert got.replace(kept, "").replace("  ", " ") == f"<p>{GERMAN}</p>"


# ------------------------------------------------------------------------------------------------------------
# Long sentences and glossaries
# ------------------------------------------------------------------------------------------------------------
def test_a_sentence_of_exactly_the_source_limit_is_not_cut(mt):  # noqa: F811
    """A sentence of as many tokens as the source limit (--max-model-len or the model's) fits whole; one token
    more, and it is cut."""
    loaded = mt.registry.models["mt"].loaded
    tokens = len(Translator(loaded).encode_source(SENTENCE, None))
    at_limit = Translator(loaded, max_source_len=tokens)
    doc = at_limit.document(SENTENCE, None, None)
    assert doc.document.segments == [SENTENCE] and len(doc.jobs[0].source_ids) == tokens
    below = Translator(loaded, max_source_len=tokens - 1).document(SENTENCE, None, None)
    assert len(below.document.segments) > 1 and all(len(j.source_ids) < tokens for j in below.jobs)


def test_glossary_entries_that_share_a_target_place_it_once(mt):  # noqa: F811
    """Two glossary entries of one sentence (another case, a longer phrase) naming the same target term ask
    for that term once: the translation is the one a single entry gives, not one forced to hold it twice."""
    single = mt.one(input=SENTENCE, glossary={"king": "Hund"}, cache=False)["translation"]
    assert single == "drei Töchter weiß der Hund"
    for glossary in ({"king": "Hund", "KING": "Hund"}, {"king": "Hund", "the king": "Hund"}):
        (job,) = mt.registry.models["mt"].engine.translator.document(SENTENCE, None, None, glossary).jobs
        assert job.constraint_terms == ["Hund"]
        assert mt.one(input=SENTENCE, glossary=glossary, cache=False)["translation"] == single, glossary


# A sentence over the fixture's 64 source tokens, which the plain cut splits between "three" and "daughters"
LONG = "the quick brown fox jumps over the lazy dog and three daughters know the king today where is the station"
TERM = {"three daughters": "drei Schwestern"}


def test_a_glossary_term_where_a_long_sentence_is_cut_stays_whole_and_is_placed(mt):  # noqa: F811
    """A term of several words across where the cut of a too-long sentence falls is kept whole in one piece:
    that piece places the term's translation, and every piece still fits the model."""
    translator = mt.registry.models["mt"].engine.translator
    plain = translator.document(LONG, None, None).document.segments
    assert plain[0].endswith(" three") and plain[1].startswith("daughters ")
    doc = translator.document(LONG, None, None, TERM)
    assert [j.constraint_terms for j in doc.jobs] == [[], ["drei Schwestern"]]
    assert all(len(j.source_ids) <= translator.max_source_len for j in doc.jobs)
    assert "drei Schwestern" in mt.one(input=LONG, glossary=TERM, cache=False)["translation"]


def test_a_glossary_term_where_a_long_sentence_is_cut_is_placed_in_a_document_of_several(mt):  # noqa: F811
    """In a document, the long sentence among others keeps its term whole too, and only its piece places it."""
    document = f"Hello world.\n{LONG}\nThe lazy dog."
    doc = mt.registry.models["mt"].engine.translator.document(document, None, None, TERM)
    assert len(doc.document.segments) == 4
    assert [j.constraint_terms for j in doc.jobs] == [[], [], ["drei Schwestern"], []]
    got = mt.one(input=document, glossary=TERM, cache=False)["translation"]
    assert got.count("drei Schwestern") == 1 and got.count("\n") == 2


def test_a_glossary_term_longer_than_the_models_input_is_a_422_naming_it(mt, monkeypatch):  # noqa: F811
    """A term that no piece the model takes can hold whole cannot be placed: a 422 naming it, as a term
    that cannot fit in max_tokens is, rather than a translation that silently lacks it."""
    monkeypatch.setattr(mt.registry.models["mt"].engine.translator, "max_source_len", 8)
    body = {"input": LONG, "glossary": {"the quick brown fox": "Wolf"}, "cache": False}
    error = mt.post("/v1/translations", body, 422).json()["error"]
    assert error["code"] == "glossary_unplaceable" and "'the quick brown fox'" in error["message"]
    assert "8 tokens" in error["message"]
    assert mt.one(input=LONG, glossary={"lazy dog": "Hund"}, cache=False)["translation"]  # a term that fits


# ------------------------------------------------------------------------------------------------------------
# The translation memory shared in a process
# ------------------------------------------------------------------------------------------------------------
def test_a_memory_shared_in_a_process_takes_the_bound_it_is_asked_for_last(tmp_path):
    """Translators of one process share the memory of one file; asked for it under another
    --translation-memory-max-entries (an app rebuilt with new settings), the memory holds that bound."""
    path = str(tmp_path / "shared.sqlite")
    first = shared_memory(path, 1000)
    assert shared_memory(path, 1000) is first
    for i in range(5):
        first.put(f"k{i}", [StoredHypothesis(f"t{i}", [i], -0.5)])
    smaller = shared_memory(path, 2)
    assert smaller.max_entries == 2
    smaller.put("k5", [StoredHypothesis("t5", [5], -0.5)])
    assert len(smaller) == 2
    assert smaller.get("k5") is not None and smaller.get("k0") is None
    assert shared_memory(None, 0) is None and shared_memory(path, 0) is None
