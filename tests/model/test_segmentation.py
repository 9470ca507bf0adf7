"""Documents into sentences and back (`model.segmentation`): the layout survives exactly, sentence ends are
found where they are and not after abbreviations, and every piece of an over-long sentence fits."""

from __future__ import annotations

import random
import re

import pytest

from tserve.model.segmentation import split_document, split_sentences

DOCUMENT = """  Click Save to keep your changes. The file is stored in the current folder!

Choose Tools - Options. Dr. Smith, e.g. a user, wrote "Is it new?" Yes, it is.
No. 5 is here... J. R. R. Tolkien paid 3.5 dollars (for the book.) Then he left
and came back.\t
"""


def test_sentences_and_layout():
    doc = split_sentences(DOCUMENT)
    assert doc.segments == [
        "Click Save to keep your changes.", "The file is stored in the current folder!",
        "Choose Tools - Options.", 'Dr. Smith, e.g. a user, wrote "Is it new?"', "Yes, it is.",
        "No. 5 is here...", "J. R. R. Tolkien paid 3.5 dollars (for the book.)", "Then he left", "and came back.",
    ]
    assert doc.layout == ["  ", " ", "\n\n", " ", " ", "\n", " ", " ", "\n", "\t\n"]
    assert doc.join(doc.segments) == DOCUMENT
    marked = doc.join([f"<{i}>" for i in range(len(doc.segments))])
    assert marked == "  <0> <1>\n\n<2> <3> <4>\n<5> <6> <7>\n<8>\t\n"


def test_whitespace_only_and_single_sentences():
    assert split_sentences("   \n ").segments == [] and split_sentences("   \n ").join([]) == "   \n "
    doc = split_sentences("Hello")
    assert doc.segments == ["Hello"] and doc.layout == ["", ""]
    assert split_sentences("it ends. but lower case goes on.").segments == ["it ends. but lower case goes on."]
    with pytest.raises(ValueError, match="2 translations for 1 segments"):
        doc.join(["a", "b"])


def test_long_sentences_are_cut_at_clauses_then_spaces_then_characters():
    sentence = "This is a rather long sentence, with clauses; and more words here: indeed it is long"
    doc = split_document(sentence, lambda s: len(s) < 30)
    assert doc.segments == ["This is a rather", "long sentence,", "with clauses;", "and more words here:",
                            "indeed it is long"]
    assert doc.join(doc.segments) == sentence
    doc = split_document("x" * 100, lambda s: len(s) <= 30)
    assert "".join(doc.segments) == "x" * 100 and all(len(s) <= 30 for s in doc.segments)


def test_random_documents_round_trip_and_every_piece_fits():
    rng = random.Random(0)
    words = ["word", "Word", "e.g.", "Dr.", "end.", "What?", "yes!", "a,", "b;", "c:", "—", "3.5", "(x.)", '"q."']
    gaps = [" ", "  ", "\n", "\n\n", "\t", " \n "]
    for _ in range(300):
        text = rng.choice(["", " ", "\n"]) + "".join(rng.choice(words) + rng.choice(gaps) for _ in range(rng.randint(1, 60)))
        limit = rng.randint(3, 40)
        doc = split_document(text, lambda s, limit=limit: len(s) <= limit)
        assert doc.join(doc.segments) == text
        assert len(doc.layout) == len(doc.segments) + 1
        assert all(s and s == s.strip() and len(s) <= limit for s in doc.segments)
        assert all(not g.strip() for g in doc.layout)


def test_a_kept_span_that_fits_is_never_cut_and_keep_is_asked_only_for_sentences_too_long():
    """A glossary term's occurrence (a kept span) ends up whole in one piece wherever the plain cut would fall
    inside it, also where only a character cut is left; every piece still fits, and a sentence that fits is
    not searched for spans."""
    rng = random.Random(1)
    words = ["word", "Word", "a,", "b;", "end.", "(x", "y)"]
    asked = []

    def keep(sentence: str) -> list[tuple[int, int]]:
        asked.append(sentence)
        return [(m.start(), m.end()) for m in re.finditer(r"word Word", sentence)]

    for _ in range(300):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        limit = rng.randint(9, 40)
        doc = split_document(text, lambda s, limit=limit: len(s) <= limit, keep)
        assert doc.join(doc.segments) == text
        assert all(s and len(s) <= limit for s in doc.segments)
        kept = sum(len(keep(s)) for s in split_document(text).segments)
        assert sum(s.count("word Word") for s in doc.segments) == kept
    asked.clear()
    doc = split_document("xxxxxxxxxx(word Word)xxxxxxxxxx. Short.", lambda s: len(s) <= 12, keep)
    assert doc.segments == ["xxxxxxxxxx", "(word Word", ")xxxxxxxxxx.", "Short."]
    assert doc.segments[-1] == "Short." and "Short." not in asked
