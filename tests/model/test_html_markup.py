"""HTML pages cut into blocks and put back: with each target word aligned to its own source word, a page comes
back exactly as it was; with alignments that reorder or cross, the markup stays well-formed and complete."""

from __future__ import annotations

import random

import pytest

from tests.http.test_html import HELP_PAGE, assert_same_markup
from tserve.model.html_markup import Atom, Span, parse_html, render_block, words

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

PAGES = [
    HELP_PAGE,
    '<p>Click <b>Save</b> to keep your <a href="x.html?a=1&amp;b=2">changes</a>.</p>',
    "<ul><li>One &amp; <i>two <u>three</u></i><br>four</li></ul>",
    "<p>line one<br>\nline two<br/>\n  line three <img src=a.png>\tfour</p>",  # the page's own whitespace after
    '<div>Run <code>ls -l</code> now&nbsp;please, <span title="a &quot;b&quot;">then <b><i>stop</i></b></span>.</div>',
    "Text without a block <b>tag</b>, and an <b>unclosed one",
    '<table><tr><td>Cell <sup>1</sup></td><th>Head</th></tr></table><p translate="no">Nein <b>danke</b></p>',
]


def identity(page: str) -> str:
    markup = parse_html(page)
    rendered = []
    for block in markup.blocks:
        w = words(block.text)
        rendered.append(render_block(block, block.text, w, w, list(range(len(w)))))
    return markup.join(rendered)


@pytest.mark.parametrize("page", PAGES)
def test_a_page_aligned_to_itself_comes_back_unchanged(page):
    assert identity(page) == page


def test_blocks_hold_the_text_and_untranslated_runs_are_verbatim():
    markup = parse_html(HELP_PAGE)
    texts = [b.text for b in markup.blocks]
    assert texts[0] == "Saving documents"
    assert texts[1].startswith("Click Save to keep your changes. The file") and "Ctrl+S" not in texts[1]
    assert "LibreOffice" not in " ".join(texts) and "soffice" not in " ".join(texts)
    assert "do not   translate &lt;this&gt;" in "".join(p for p in markup.parts if isinstance(p, str))
    link = markup.blocks[1].children[1]
    assert isinstance(link, Span) and markup.blocks[1].text[link.start: link.end] == "changes"
    assert any(isinstance(c, Atom) and c.raw == "<br>" for c in markup.blocks[1].children)


@pytest.mark.parametrize("seed", range(20))
def test_any_alignment_gives_well_formed_html_with_every_tag(seed):
    rng = random.Random(seed)
    page = PAGES[seed % len(PAGES)]
    markup = parse_html(page)
    rendered = []
    for block in markup.blocks:
        source_words = words(block.text)
        target = " ".join(rng.choice(["Wort", "zwei", "drei", "."]) for _ in range(rng.randint(1, 12)))
        target_words = words(target)
        aligned = [rng.randrange(-1, len(source_words)) for _ in target_words]
        rendered.append(render_block(block, target, target_words, source_words, aligned))
    assert_same_markup(markup.join(rendered), page)


def test_a_reordered_translation_moves_the_tag_with_its_word():
    block = parse_html("<p>the <b>red</b> car</p>").blocks[0]
    target = "das Auto ist rot"
    out = render_block(block, target, words(target), words(block.text), [0, 2, -1, 1])
    assert out == "das Auto ist <b>rot</b>"
