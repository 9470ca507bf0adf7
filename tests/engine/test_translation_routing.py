"""Which served translators a language pair goes through (`service.translation.routing`), for every combination
of served models: a pair some model has directly never goes through a pivot; of two that have it, the one-pair
model unless --prefer-multilingual; a pair none has goes through --pivot-language, each hop on a model that has
that hop's pair. Then how a request's route is picked and named in its errors, and how a text goes through one
hop or two (`translate_route`), with stand-ins for the served models: routing reads only their languages, and
a route their documents and results (no model, no server)."""

from __future__ import annotations

import asyncio
import itertools
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tserve.model.segmentation import Document
from tserve.service.engine.output import Hypothesis
from tserve.service.errors import APIError
from tserve.service.settings import Settings
from tserve.service.translation.inputs import TranslationAsk
from tserve.service.translation.routing import (
    _joined,
    hop_ask,
    pair_list,
    pick_route,
    route_for,
    routes_by_pair,
    translate_route,
)
from tserve.service.translation.served import SegmentResult, ServedTranslator, TranslationOutput, assemble


def _translator(name: str, pair: tuple[str, str] | None = None, codes: tuple[str, ...] = ()) -> ServedTranslator:
    served = object.__new__(ServedTranslator)  # routing reads its name and languages only
    served.name = name
    served.loaded = SimpleNamespace(languages=pair, tokenizer=SimpleNamespace(language_codes=list(codes)))
    return served


MODELS = {
    "de-en": _translator("de-en", ("de", "en")),
    "en-fr": _translator("en-fr", ("en", "fr")),
    "en-de": _translator("en-de", ("en", "de")),
    "nllb": _translator("nllb", codes=("deu_Latn", "fra_Latn", "eng_Latn")),
}
LANGUAGES = ("de", "en", "fr")


def _registry(names: tuple[str, ...], prefer_multilingual: bool) -> SimpleNamespace:
    return SimpleNamespace(models={n: MODELS[n] for n in names}, derived=lambda _, compute: compute(),
                           settings=Settings(prefer_multilingual=prefer_multilingual))


def _direct(names: tuple[str, ...], pair: tuple[str, str]) -> list[str]:
    """The served models that have `pair` themselves."""
    return [n for n in names if MODELS[n].loaded.languages == pair
            or (n == "nllb" and pair[0] != pair[1])]


@pytest.mark.parametrize("prefer_multilingual", [False, True])
def test_a_pair_some_model_has_never_goes_through_a_pivot(prefer_multilingual):
    for count in range(1, len(MODELS) + 1):
        for names in itertools.combinations(MODELS, count):
            routes = routes_by_pair(_registry(names, prefer_multilingual))
            for pair in itertools.permutations(LANGUAGES, 2):
                direct = _direct(names, pair)
                hops = routes.get(pair)
                where = f"{pair} with {names}"
                if direct:
                    assert hops is not None and len(hops) == 1, where
                    one_pair = [n for n in direct if n != "nllb"]
                    expected = "nllb" if "nllb" in direct and (prefer_multilingual or not one_pair) else one_pair[0]
                    assert hops[0][0].name == expected and hops[0][1] == pair, where
                    continue
                into = _direct(names, (pair[0], "en"))
                out_of = _direct(names, ("en", pair[1]))
                if "en" in pair or not into or not out_of:
                    assert hops is None, where
                    continue
                assert [hop_pair for _, hop_pair in hops] == [(pair[0], "en"), ("en", pair[1])], where
                assert hops[0][0].name in into and hops[1][0].name in out_of, where


def test_a_pair_is_found_however_users_write_its_languages_and_a_missing_one_names_the_served():
    reg = _registry(("de-en", "en-fr"), prefer_multilingual=False)
    assert [(hop[0].name, hop[1]) for hop in route_for(reg, "deu", "en-GB")] == [("de-en", ("de", "en"))]
    assert [hop[1] for hop in route_for(reg, "de", "fra")] == [("de", "en"), ("en", "fr")]
    with pytest.raises(APIError) as refused:
        route_for(reg, "fr", "de")
    assert (refused.value.status, refused.value.code) == (400, "unsupported_pair")
    assert refused.value.message == "fr→de is not served (served: de→en, de→fr, en→fr)"
    assert pair_list({}) == "none"


def test_without_a_target_the_only_direct_one_of_the_source_is_taken():
    reg = _registry(("de-en", "en-fr", "en-de"), prefer_multilingual=False)
    route = asyncio.run(pick_route(reg, ["Hallo"], "de", None))
    assert [hop[1] for hop in route] == [("de", "en")]  # de→fr goes through a pivot: not a direct target
    with pytest.raises(APIError) as refused:
        asyncio.run(pick_route(reg, ["Hello"], "en", None))
    assert refused.value.code == "model_required" and "translates into de, fr)" in refused.value.message
    with pytest.raises(APIError, match="translates into nothing served"):
        asyncio.run(pick_route(reg, ["Bonjour"], "fr", None))
    assert [hop[1] for hop in asyncio.run(pick_route(reg, ["x"], "en", "de"))] == [("en", "de")]


def test_a_first_hop_is_asked_one_beam_and_no_alternatives_the_last_hop_the_request():
    """The first hop: the checkpoint's beams, one alternative, the glossary as asked (its source terms are in the
    request's source language; it places their target terms in the pivot language's text); the last: the
    request's beams and alternatives, and the placed terms kept as they are."""
    ask = TranslationAsk(["Hallo"], num_beams=4, max_tokens=9, n=3, glossary={"a": "b", "c": "d"},
                         source_lang="de", target_lang="fr", cache=False)
    route = ((MODELS["de-en"], ("de", "en")), (MODELS["en-fr"], ("en", "fr")))
    first = hop_ask(ask, route, 0, ["Hallo."])
    assert first == TranslationAsk(["Hallo."], None, 9, 1, {"a": "b", "c": "d"}, False, "de", "en", cache=False)
    last = hop_ask(ask, route, 1, ["Hello."])
    assert last == replace(ask, texts=["Hello."], source_lang="en", target_lang="fr", glossary={"b": "b", "d": "d"})
    (direct,) = route[:1]
    assert hop_ask(ask, (direct,), 0, ["x"]) == replace(ask, texts=["x"], source_lang="de", target_lang="en")


def test_a_documents_sentences_from_two_hops_join_into_its_layout_with_alternatives():
    doc = SimpleNamespace(document=Document(["A.", "B."], ["", " ", "\n"]))
    sentences = [TranslationOutput("Eins.", [1, 2], -1.0, "stop", [("Eins.", -1.0), ("Ein.", -2.0)]),
                 TranslationOutput("Zwei.", [3, 4, 5, 6], -0.5, "length", [("Zwei.", -0.5)])]
    joined = _joined(doc, sentences, n=2)
    assert (joined.text, joined.token_ids, joined.finish_reason) == ("Eins. Zwei.\n", [1, 2, 3, 4, 5, 6], "length")
    assert joined.score == pytest.approx((-1.0 * 2 - 0.5 * 4) / 6)  # weighted by each sentence's tokens
    # alternative 1: the first sentence's second, the second's last (it has one); weighted by words
    assert joined.alternatives == [("Eins. Zwei.\n", joined.score), ("Ein. Zwei.\n", pytest.approx(-1.25))]
    assert _joined(doc, [replace(s, finish_reason="stop") for s in sentences], n=1).alternatives == \
        [("Eins. Zwei.\n", joined.score)]
    assert _joined(doc, [replace(s, finish_reason="stop") for s in sentences], n=1).finish_reason == "stop"


class StandInTranslator:
    """What `translate_route` reads of a served translator: a sentence is a segment (split after '. '), its
    ids one per character, its translation the sentence with `-tag` before its full stop (one that begins with
    '-' translates to nothing);
    `results_as_ready` gives the sentences last first, and every call is recorded."""

    def __init__(self, name: str, pair: tuple[str, str], tag: str) -> None:
        self.name, self.tag, self.calls = name, tag, []
        self.loaded = SimpleNamespace(languages=pair, generation=SimpleNamespace(num_beams=2),
                                      tokenizer=SimpleNamespace(language_codes=[]))
        self.language_codes, self.settings = [], Settings()
        self.engine = SimpleNamespace(translator=SimpleNamespace(max_target_len=64))

    def check(self, ask: TranslationAsk) -> None:
        """The served translator's own check (the one validator, against this stand-in's limits)."""
        self.calls.append(("check", ask))
        return ServedTranslator.check(self, ask)

    def documents(self, ask: TranslationAsk, languages: None) -> list[SimpleNamespace]:
        self.calls.append(("documents", ask))
        docs = []
        for text in ask.texts:
            segments = text.split(". ")
            segments = [s + "." for s in segments[:-1]] + segments[-1:]
            docs.append(SimpleNamespace(document=Document(segments, ["", *[" "] * (len(segments) - 1), ""]),
                                        jobs=[SimpleNamespace(source_ids=list(range(len(s)))) for s in segments]))
        return docs

    def _result(self, segment: str) -> SegmentResult:
        text = "" if segment.startswith("-") else re.sub(r"(\.?)$", rf"-{self.tag}\1", segment, count=1)
        return SegmentResult(text, list(range(len(text))), [Hypothesis(text, list(range(len(text))), -0.5)], "stop")

    async def translate(self, request, docs, n=1, cache=True) -> list[TranslationOutput]:  # noqa: ANN001
        self.calls.append(("translate", n, cache))
        return [assemble(d, [self._result(s) for s in d.document.segments], n) for d in docs]

    async def results_as_ready(self, docs, cache=True, group=None, first_turn=0):  # noqa: ANN001, ANN201
        self.calls.append(("as_ready", cache, group, first_turn))
        segments = [s for d in docs for s in d.document.segments]
        for k in reversed(range(len(segments))):
            yield k, self._result(segments[k])


class Connected:
    async def is_disconnected(self) -> bool:
        return False


def _hops(*translators: StandInTranslator) -> tuple:
    return tuple((t, t.loaded.languages) for t in translators)


def test_one_hop_is_the_models_own_translation():
    de_en = StandInTranslator("de-en", ("de", "en"), "en")
    ask = TranslationAsk(["Eins. Zwei", "Drei"], n=2, num_beams=2, source_lang="de", target_lang="en", cache=False)
    result = asyncio.run(translate_route(Connected(), _hops(de_en), ask))
    assert [o.text for o in result.outputs] == ["Eins-en. Zwei-en", "Drei-en"]
    assert (result.prompt_tokens, result.completion_tokens) == (5 + 4 + 4, 8 + 7 + 7)
    assert de_en.calls == [("check", ask), ("documents", ask), ("translate", 2, False)]  # the last: asked as is


def test_two_hops_take_each_sentence_on_as_the_first_finishes_it():
    de_en, en_fr = StandInTranslator("de-en", ("de", "en"), "en"), StandInTranslator("en-fr", ("en", "fr"), "fr")
    ask = TranslationAsk(["Eins. Zwei", "-. Drei", "Vier. Fünf"], source_lang="de", target_lang="fr", cache=False)
    result = asyncio.run(translate_route(Connected(), _hops(de_en, en_fr), ask))
    assert [o.text for o in result.outputs] == ["Eins-en-fr. Zwei-en-fr", " Drei-en-fr", "Vier-en-fr. Fünf-en-fr"]
    assert [o.finish_reason for o in result.outputs] == ["stop", "stop", "stop"]
    assert result.prompt_tokens == 5 + 4 + 2 + 4 + 5 + 4  # the sources, as the first hop read them
    first_hop = 8 + 7 + 0 + 7 + 8 + 7
    assert result.completion_tokens == first_hop + 11 + 10 + 10 + 11 + 10
    assert de_en.calls[-1] == ("as_ready", False, None, 0)
    # each model checked the request once, before any work, not the second again for every sentence
    assert [c[0] for c in de_en.calls][:1] == ["check"] and [c[0] for c in en_fr.calls].count("check") == 1
    assert [c[0] for c in de_en.calls].count("check") == 1 and en_fr.calls[0][0] == "check"
    # each sentence went on alone, as its document's k-th part of one client request on the second model
    asked = [c[1].texts for c in en_fr.calls if c[0] == "documents"]
    assert sorted(asked) == [["Drei-en"], ["Eins-en."], ["Fünf-en"], ["Vier-en."], ["Zwei-en"]]
    turns = sorted((c[3], c[1]) for c in en_fr.calls if c[0] == "as_ready")
    assert turns == [(0, False), (0, False), (1, False), (1, False), (1, False)]
    (group,) = {c[2] for c in en_fr.calls if c[0] == "as_ready"}
    assert group is not None


def test_two_hops_check_the_last_models_options_before_any_work():
    de_en, en_fr = StandInTranslator("de-en", ("de", "en"), "en"), StandInTranslator("en-fr", ("en", "fr"), "fr")
    ask = TranslationAsk(["Eins"], n=3, source_lang="de", target_lang="fr")
    with pytest.raises(APIError) as refused:
        asyncio.run(translate_route(Connected(), _hops(de_en, en_fr), ask))
    worked = lambda t: [c for c in t.calls if c[0] != "check"]  # noqa: E731
    assert (refused.value.status, refused.value.code) == (400, "invalid_n") and not worked(de_en)
    too_long = TranslationAsk(["Eins"], max_tokens=65, source_lang="de", target_lang="fr")  # en-fr takes 64
    with pytest.raises(APIError) as refused:
        asyncio.run(translate_route(Connected(), _hops(de_en, en_fr), too_long))
    assert refused.value.code == "max_tokens_too_large" and not worked(de_en)


def test_an_html_page_goes_through_each_hop_whole():
    de_en, en_fr = StandInTranslator("de-en", ("de", "en"), "en"), StandInTranslator("en-fr", ("en", "fr"), "fr")
    ask = TranslationAsk(["Eins. Zwei"], html=True, source_lang="de", target_lang="fr")
    result = asyncio.run(translate_route(Connected(), _hops(de_en, en_fr), ask))
    assert [o.text for o in result.outputs] == ["Eins-en-fr. Zwei-en-fr"]
    assert (result.prompt_tokens, result.completion_tokens) == (5 + 4, 8 + 7 + 11 + 10)
    assert [c[1] for c in de_en.calls if c[0] == "translate"] == [1]


def test_a_failing_second_hop_fails_the_request_as_a_translation_failure():
    class Failing(StandInTranslator):
        async def results_as_ready(self, docs, cache=True, group=None, first_turn=0):  # noqa: ANN001, ANN201
            raise RuntimeError("")
            yield

    de_en, en_fr = StandInTranslator("de-en", ("de", "en"), "en"), Failing("en-fr", ("en", "fr"), "fr")
    with pytest.raises(APIError) as failed:
        asyncio.run(translate_route(Connected(), _hops(de_en, en_fr), TranslationAsk(["Eins"], source_lang="de",
                                                                                      target_lang="fr")))
    assert (failed.value.status, failed.value.code, failed.value.message) == (500, "translation_failed",
                                                                             "translation failed")
