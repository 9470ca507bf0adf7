"""Translation options that each work alone, checked where they meet: HTML, max_tokens, alternatives and a
detected source on a pivoted pair; the translation memory beside alternatives, a glossary and a multilingual
model's HTML; a glossary beside beams and HTML; an HTML block of several sentences beside word alignments;
alternatives beside return_alignment and streaming. Every app runs in this process (`httpx.ASGITransport`), its
models the committed fixtures, each with its own translation memory file, so that the tests take seconds."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tests.http.test_html import assert_same_markup
from tests.http.test_pivot_http import pivot_checkpoints
from tserve.model.segmentation import split_sentences
from tserve.service.engine.output import Hypothesis
from tserve.service.engine.translation_input import DocumentJob
from tserve.service.translation.served import SegmentResult, assemble

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


class InProcess(InProcessApp):
    """A translator app in this process, with its own translation memory file."""

    def __init__(self, models: dict, memory) -> None:  # noqa: ANN001 - a path
        super().__init__(models, translation_memory=str(memory))

    def v1(self, **body) -> dict:
        return self.post("/v1/translations", body).json()

    def one(self, **body) -> dict:
        (item,) = self.v1(**body)["data"]
        return item

    def lt(self, **body) -> dict:
        return self.post("/translate", body).json()


def in_process(tmp_path_factory, name: str, checkpoints) -> InProcess:  # noqa: ANN001 - pytest's, root -> models
    root = tmp_path_factory.mktemp(name)
    return InProcess(checkpoints(root), root / "memory.sqlite")


@pytest.fixture(scope="module")
def pivot(tmp_path_factory):
    """German → English and English → "French": de → fr pivots."""
    app = in_process(tmp_path_factory, "pivot", pivot_checkpoints)
    yield app
    app.registry.stop()


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    """English → German, word for word (the lexicon fixture whose alignment heads are known)."""
    app = in_process(tmp_path_factory, "aligned", lambda root: {"mt": factories.aligned_mt_dir(root / "mt")})
    yield app
    app.registry.stop()


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    app = in_process(tmp_path_factory, "nllb", lambda root: {"nllb": factories.hf_nllb_dir(root / "nllb")})
    yield app
    app.registry.stop()


def plain(page: str) -> str:
    return re.sub(r"<[^>]+>", "", page)


# ------------------------------------------------------------------------------------------------------------
# A pivoted pair (de → en → fr)
# ------------------------------------------------------------------------------------------------------------
def test_an_html_page_keeps_its_markup_and_text_through_a_pivot(pivot):
    """Over two hops an HTML page goes through each whole: the first hop must read it as HTML too, or its tags
    are translated as words and the second hop gets something else."""
    sentence = "der König ist heute schön"
    page = "<p>der <b>König</b> ist heute schön</p>"
    got = pivot.lt(q=page, source="de", target="fr", format="html")
    assert got["models"] == ["de-en", "en-fr"]
    assert_same_markup(got["translatedText"], page)
    assert plain(got["translatedText"]) == pivot.lt(q=sentence, source="de", target="fr")["translatedText"]


def test_max_tokens_bounds_both_hops_of_a_pivot(pivot):
    """max_tokens is per sentence at each hop: the pivot answers what the two models answer one after the
    other, each held to it."""
    sentence = "der König ist heute schön"
    english = pivot.one(model="de-en", input=sentence, max_tokens=6, cache=False)["translation"]
    french = pivot.one(model="en-fr", input=english, max_tokens=6, cache=False)["translation"]
    full = pivot.one(model="de-en", input=sentence, cache=False)["translation"]
    unbounded_first = pivot.one(model="en-fr", input=full, max_tokens=6, cache=False)["translation"]
    assert french != unbounded_first, "max_tokens 6 must change what the first hop hands on for this test to tell"
    assert pivot.one(input=sentence, source_lang="de", target_lang="fr", max_tokens=6,
                     cache=False)["translation"] == french


@pytest.mark.parametrize(("source", "hops"), [("de", ["de-en", "en-fr"]), ("en", ["en-fr"])])
def test_libretranslate_alternatives_are_the_last_hops_beyond_the_checkpoints_beams(pivot, source, hops):
    """`alternatives` asks the last model for that many more beams than its checkpoint's (2 here) and no hop
    before it for any: over a pivot, and on one hop, they are what that model answers with n = alternatives + 1."""
    text = "drei Töchter" if source == "de" else "three daughters"
    got = pivot.lt(q=text, source=source, target="fr", alternatives=2)
    assert got.get("models", hops) == hops
    last_input = text if source == "en" else pivot.one(model="de-en", input=text)["translation"]
    want = pivot.one(model="en-fr", input=last_input, n=3, num_beams=3)
    assert got["translatedText"] == want["translation"]
    assert got["alternatives"] == [a["translation"] for a in want["alternatives"][1:]]
    assert len(got["alternatives"]) == 2


def test_libretranslate_alternatives_beyond_a_one_hop_models_beams(pivot):
    """de → en is one hop on a checkpoint of 2 beams: 2 alternatives (n = 3) raise its beams to 3."""
    got = pivot.lt(q="drei Töchter", source="de", target="en", alternatives=2)
    want = pivot.one(model="de-en", input="drei Töchter", n=3, num_beams=3)
    assert got["alternatives"] == [a["translation"] for a in want["alternatives"][1:]] and len(got["alternatives"]) == 2


def test_a_batch_with_detected_languages_sends_each_text_through_its_own_route(pivot):
    """source "auto" over a list of texts in several languages: each text's route (direct or pivoted) gets that
    text, in the order given."""
    texts = ["the king is nice today", "Guten Morgen, wo ist der Bahnhof?", "where is the station"]
    got = pivot.lt(q=texts, source="auto", target="fr")
    assert [d["language"] for d in got["detectedLanguage"]] == ["en", "de", "en"]
    assert got["models"] == [["en-fr"], ["de-en", "en-fr"], ["en-fr"]]
    alone = [pivot.lt(q=t, source=d["language"], target="fr")["translatedText"]
             for t, d in zip(texts, got["detectedLanguage"], strict=True)]
    assert len(set(alone)) == 3
    assert got["translatedText"] == alone


# ------------------------------------------------------------------------------------------------------------
# The translation memory beside other options
# ------------------------------------------------------------------------------------------------------------
def test_the_memory_answers_alternatives_as_a_fresh_translation_would(mt):
    """A sentence's memory entry keeps every hypothesis of its beams, so n alternatives come from it too."""
    body = {"input": "three daughters know the king", "n": 3, "num_beams": 4}
    fresh = mt.one(**body, cache=False)
    assert len(fresh["alternatives"]) == 3
    assert mt.one(**body) == fresh  # translated and kept
    assert mt.one(**body) == fresh  # answered from the memory


def test_a_glossary_request_is_not_answered_with_a_translation_kept_without_it(mt):
    sentence = "three daughters know the king"
    without = mt.one(input=sentence)  # kept in the memory
    glossary = {"king": "Hund"}
    fresh = mt.one(input=sentence, glossary=glossary, cache=False)
    assert "Hund" in fresh["translation"] and "Hund" not in without["translation"]
    assert mt.one(input=sentence, glossary=glossary) == fresh
    assert mt.one(input=sentence, glossary=glossary) == fresh
    # Another glossary for the same sentence (the same beams: a term each) is not answered with the first's.
    other = mt.one(input=sentence, glossary={"king": "Fuchs"})
    assert "Fuchs" in other["translation"] and "Hund" not in other["translation"]


def test_the_memory_tells_an_html_pages_language_pairs_apart(nllb):
    """A multilingual model's HTML page: its sentences are kept under the page's languages, so the same page
    asked in the other direction is translated, not answered with the first direction's sentences."""
    page = "<p>the king is <b>nice</b> today</p>"
    fresh = {pair: nllb.one(input=page, format="html", source_lang=pair[0], target_lang=pair[1], cache=False)
             for pair in (("en", "de"), ("de", "en"))}
    assert fresh[("en", "de")]["translation"] != fresh[("de", "en")]["translation"]
    for _ in range(2):
        for (source, target), want in fresh.items():
            got = nllb.one(input=page, format="html", source_lang=source, target_lang=target)
            assert got == want, (source, target)


def test_an_html_pages_sentences_are_answered_from_what_a_text_request_kept(nllb):
    """A multilingual model's sentence is kept under its languages whichever format asked for it: the same
    sentence in an HTML page, in the same languages, is answered from the memory."""
    memory = nllb.registry.models["nllb"].memory
    sentence = "good morning where is the station"
    text = nllb.one(input=sentence, source_lang="en", target_lang="de")["translation"]  # kept
    hits = memory.hits
    page = nllb.one(input=f"<p>{sentence}</p>", format="html", source_lang="en", target_lang="de")
    assert memory.hits == hits + 1
    assert page["translation"] == f"<p>{text}</p>"


# ------------------------------------------------------------------------------------------------------------
# A glossary beside beams and HTML
# ------------------------------------------------------------------------------------------------------------
def test_a_glossary_takes_at_least_four_beams_and_keeps_more_when_asked(mt):
    """A sentence with a glossary term is searched with at least 4 beams; a request for more keeps its own."""
    served = mt.registry.models["mt"]
    glossary = {"king": "Hund"}
    for asked, searched in ((1, 4), (4, 4), (6, 6)):
        (job,) = served.engine.translator.document("three daughters know the king", asked, None, glossary).jobs
        assert (job.num_beams, job.constraint_terms) == (searched, ["Hund"]), asked
    item = mt.one(input="three daughters know the king", glossary=glossary, num_beams=6, n=6, cache=False)
    assert all("Hund" in a["translation"] for a in item["alternatives"])


def test_glossary_terms_are_placed_in_an_html_pages_text(mt):
    """An HTML page's blocks are documents like a text's: the glossary applies to their sentences too."""
    glossary = {"fox": "Hund"}
    text = mt.one(input="the quick brown fox jumps", glossary=glossary, cache=False)["translation"]
    page = "<p>the quick <b>brown</b> fox jumps</p>"
    got = mt.one(input=page, format="html", glossary=glossary, cache=False)["translation"]
    assert "Hund" in text
    assert_same_markup(got, page)
    assert plain(got) == text


# ------------------------------------------------------------------------------------------------------------
# HTML beside several sentences, alignments and alternatives; a streamed document's alternatives
# ------------------------------------------------------------------------------------------------------------
def test_a_blocks_second_sentence_aligns_to_its_own_words(mt):
    """A block of two sentences: the second's target words point at the second's source words (numbered across
    the block), and its inline tag lands on its own translation."""
    page = "<p>hello world. The quick <b>brown</b> fox jumps</p>"
    item = mt.one(input=page, format="html", num_beams=1, return_alignment=True, cache=False)
    (segment,) = item["segments"]
    first = segment["source_words"].index("The")  # where the second sentence starts
    second_target = segment["target_words"].index("schnelle")
    assert segment["source_words"][first:] == ["The", "quick", "brown", "fox", "jumps"]
    assert segment["alignment"][:second_target] == list(range(second_target))
    assert all(a >= first for a in segment["alignment"][second_target:]), segment
    (tag,) = segment["tags"]
    assert tag["source_words"] == [first + 2]
    assert [segment["target_words"][i] for i in tag["target_words"]] == ["braune"]
    assert "<b>braune</b>" in item["translation"]


def test_html_alternatives_with_return_alignment_report_the_best(mt):
    """Each alternative of a page is rendered by its own alignment; return_alignment reports the best's."""
    page = "<p>the quick <b>brown</b> fox jumps</p>"
    item = mt.one(input=page, format="html", num_beams=2, n=2, return_alignment=True, cache=False)
    alone = mt.one(input=page, format="html", num_beams=2, n=2, cache=False)
    assert item["alternatives"] == alone["alternatives"] and len(item["alternatives"]) == 2
    (segment,) = item["segments"]
    assert segment["translation"] == plain(item["translation"])
    for alternative in item["alternatives"]:
        assert_same_markup(alternative["translation"], page)


def test_a_streamed_document_ends_with_the_alternatives_it_answers_whole(mt):
    """A document streamed segment by segment with n > 1: its last chunk carries the alternatives the
    non-streaming answer has."""
    body = {"input": "the quick brown fox jumps. Where is the station today", "n": 2, "num_beams": 4,
            "cache": False}
    whole = mt.one(**body)
    assert len(whole["alternatives"]) == 2
    text = mt.post("/v1/translations", body | {"stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert len(chunks) == 2  # one per sentence
    last = chunks[-1]["data"][0]
    assert last["translation"] == whole["translation"]
    assert last["alternatives"] == whole["alternatives"]


def test_n_up_to_the_requests_own_beams_beyond_the_checkpoints(mt):
    """n is bounded by the beams the request asks for, not the checkpoint's (2 here)."""
    item = mt.one(input="three daughters know the king", n=3, num_beams=4, cache=False)
    assert len(item["alternatives"]) == 3
    mt.post("/v1/translations", {"input": "three daughters know the king", "n": 3}, 400)


def test_a_documents_alternatives_go_as_far_as_its_sentence_with_the_most():
    """A document's alternative k takes each sentence's k-th distinct hypothesis (its last where it has fewer):
    a sentence every beam spells the same way does not cut the others' alternatives short."""
    doc = DocumentJob(split_sentences("Hello. Where is the station?"), [None, None])

    def segment(*texts: str) -> SegmentResult:
        hypotheses = [Hypothesis(t, [i + 1], -0.1 * (i + 1)) for i, t in enumerate(texts)]
        return SegmentResult(texts[0], [1], hypotheses, "stop")

    out = assemble(doc, [segment("Hallo.", "Hallo."), segment("Wo ist der Bahnhof?", "Wo der Bahnhof?", "Bahnhof?")], 3)
    assert [text for text, _ in out.alternatives] == [
        "Hallo. Wo ist der Bahnhof?", "Hallo. Wo der Bahnhof?", "Hallo. Bahnhof?"]
    assert len(assemble(doc, [segment("Hallo."), segment("Wo ist der Bahnhof?", "Wo der Bahnhof?")], 1).alternatives) == 1


@pytest.mark.parametrize(("text", "glossary", "plain"), [
    ("three daughters know the king", {"king": "König"}, "drei Töchter weiß der König"),
    ("the quick brown fox jumps", {"fox": "Hund"}, "der schnelle braune Hund springt"),
    ("where is the station today", {"station": "Bahnhof"}, "wo ist der Bahnhof heute")], ids=["king", "fox", "station"])
def test_a_term_of_more_tokens_than_beams_is_placed_where_its_word_goes(mt, text, glossary, plain):
    """A term of 4 tokens or more under the default 4 beams: more banks (tokens placed: 0 to the term's length) than
    beams. The hypotheses that have placed nothing yet must keep a beam, or every one left has started the term at
    its first steps ("König Töchter weiß der König"); the term then goes where the model writes its word."""
    served = mt.registry.models["mt"]
    (job,) = served.engine.translator.document(text, 1, None, glossary).jobs
    assert job.num_beams == 4 and len(job.constraints[0]) >= 4
    assert mt.one(input=text, glossary=glossary, cache=False)["translation"] == plain
