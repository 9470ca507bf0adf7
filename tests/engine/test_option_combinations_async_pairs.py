"""Asynchronous scheduling (`--async-scheduling on`: a step is launched before the tokens of the step before are
read) where it meets another feature: a multilingual translator's forced first token (the target language's code)
and a Marian translator's forced eos at the length limit, both decided by how many tokens a row has chosen, which
counts the ones still on the device; and the server's setting reaching the engines it builds. The reference is the
synchronous engine, event for event, on the same requests."""

from __future__ import annotations

import pytest

from tests.engine.test_async_translation import counting_rows, engine_of, streams
from tests.helpers import factories
from tests.helpers.fixture_training import lexicon_sentences
from tserve.model import checkpoint
from tserve.service.metrics import Metrics
from tserve.service.settings import Settings

TRANSLATORS = {"nllb": (factories.hf_nllb_dir, ("eng_Latn", "deu_Latn")), "marian": (factories.hf_marian_dir, None)}


@pytest.fixture(scope="module", params=list(TRANSLATORS))
def translator(request, tmp_path_factory):
    """A checkpoint whose greedy rows are forced one token by their position: NLLB's language code first, Marian's
    eos at max_tokens (its `forced_eos_token_id`); with the languages its jobs name."""
    make, languages = TRANSLATORS[request.param]
    return request.param, checkpoint.load(make(tmp_path_factory.mktemp(request.param)), device="cpu"), languages


def test_forced_first_and_last_tokens_come_where_the_synchronous_engine_puts_them(translator):
    """Greedy rows (cut by max_tokens or ended by eos) batched with 2-beam rows: with steps launched before the
    last tokens are read, a row's second step must not be forced the language code again (its first token is
    still on the device), and the step that chooses its last token must be forced eos. The overlapped engine's
    events are the synchronous engine's, and the forced tokens are where the checkpoint says."""
    name, mt, languages = translator
    texts = lexicon_sentences(10, seed=23, min_words=3, max_words=9)
    reference = engine_of(mt, "off")
    jobs = [reference.translator.job(t, num_beams=2 if i % 4 == 3 else 1, max_tokens=(3, 5, 40)[i % 3],
                                     languages=languages) for i, t in enumerate(texts)]
    expected = streams(reference, jobs)
    overlapped = engine_of(mt, "on")
    launched = counting_rows(overlapped)
    assert streams(overlapped, jobs) == expected
    assert any(unread for _, unread in launched)  # steps really were launched with tokens unread
    greedy = [(s[-1][3][0][1], j.max_new_tokens) for s, j in zip(expected, jobs, strict=True) if j.num_beams == 1]
    if name == "nllb":  # the language code first, and not again right after it
        code = mt.tokenizer.language_codes[languages[1]]
        assert all(ids[0] == code and ids[1] != code for ids, _ in greedy if len(ids) > 1)
    else:  # a row that reaches max_tokens ends with the forced eos there
        cut = [ids for ids, limit in greedy if len(ids) == limit]
        assert len(cut) >= 3 and all(ids[-1] == mt.config.eos_token_id for ids in cut)


def test_the_servers_async_scheduling_setting_reaches_the_language_model_and_the_translator(tmp_path):
    """--async-scheduling on / off is passed to every engine the server builds, a translator's as well as a
    language model's (on a CPU, `auto` means off: a setting dropped on one path would leave it synchronous)."""
    from tserve.service.generation.served import ServedLanguageModel
    from tserve.service.translation.served import ServedTranslator

    lm = checkpoint.load(factories.tiny_lm_dir(tmp_path / "lm"), device="cpu")
    mt = checkpoint.load(factories.tiny_mt_dir(tmp_path / "mt", trained=False), device="cpu")
    for mode, overlaps in (("on", True), ("off", False), ("auto", False)):
        settings = Settings(device="cpu", async_scheduling=mode, cuda_graphs=False, translation_memory_max_entries=0)
        assert ServedLanguageModel("lm", lm, settings, Metrics()).engine.overlap is overlaps, mode
        assert ServedTranslator("mt", mt, settings, Metrics()).engine.overlap is overlaps, mode
