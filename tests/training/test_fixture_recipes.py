"""The recipes of the committed test fixtures (`tests/helpers/factories.RECIPES`) still yield fixtures that
behave as the tests need, on this machine, so that the fixtures can be made again. The committed files are
what the other tests use; these runs are compared with the behaviour, not with those files' bits (another
CPU trains other bits)."""

from __future__ import annotations

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import (
    CYCLE_TEXT,
    LEXICON,
    lexicon_sentences,
    sentences_where_beams_matter,
)
from tests.helpers.one_request import lm_tokens
from tserve.model.checkpoint import load
from tserve.model.decoding import SamplingParams, translate

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


def cycle_continuation_rate(loaded, prompts: int = 12, words: int = 4) -> float:  # noqa: ANN001
    """How many prompts cut from the cycle are continued greedily with the cycle's next `words` words."""
    cycle = CYCLE_TEXT.split()
    hits = 0
    for start in range(0, prompts * 7, 7):
        prompt = " ".join(cycle[start : start + 6])
        ids = lm_tokens(loaded, loaded.tokenizer.encode(prompt), SamplingParams(max_tokens=24, temperature=0.0),
                        with_eos=False)
        hits += loaded.tokenizer.decode(ids).split()[:words] == cycle[start + 6 : start + 6 + words]
    return hits / prompts


def lexicon_rate(loaded, n: int = 24) -> float:  # noqa: ANN001
    """How many short lexicon sentences are translated greedily word for word."""
    sources = lexicon_sentences(n, seed=5, max_words=6)
    outs = translate(loaded, [loaded.tokenizer.encode(s) for s in sources], num_beams=1, max_new_tokens=30)
    expected = [" ".join(LEXICON[w] for w in s.split()) for s in sources]
    return sum(loaded.tokenizer.decode(o.output_ids).strip() == e for o, e in zip(outs, expected, strict=True)) / n


@pytest.mark.slow
def test_the_committed_fixtures_and_a_fresh_decoder_recipe_learn_the_cycle(tmp_path):
    committed = load(factories.tiny_lm_dir(tmp_path / "committed"))
    fresh = load(factories.RECIPES["tiny-lm"](tmp_path / "fresh"))
    assert cycle_continuation_rate(committed) >= 0.9
    assert cycle_continuation_rate(fresh) >= 0.9


@pytest.mark.slow
def test_the_committed_fixtures_and_a_fresh_translator_recipe_learn_the_lexicon_and_leave_room_for_beams(tmp_path):
    committed = load(factories.tiny_mt_dir(tmp_path / "committed"))
    fresh = load(factories.RECIPES["tiny-mt"](tmp_path / "fresh"))
    for loaded in (committed, fresh):
        assert lexicon_rate(loaded) >= 0.6  # the committed one: 71%; a random one: none
        sentences_where_beams_matter(loaded, 1)  # fails when 4 beams never find another translation


def test_every_recipe_has_its_committed_fixture(tmp_path):
    for name in factories.RECIPES:
        copied = factories.copy_fixture(name, tmp_path / name)
        assert (copied / "config.json").is_file() and any(copied.glob("*.safetensors")), name
