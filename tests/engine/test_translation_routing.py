"""Which served translators a language pair goes through (`service.translation.routing`), for every combination
of served models: a pair some model has directly never goes through a pivot; of two that have it, the one-pair
model unless --prefer-multilingual; a pair none has goes through --pivot-language, each hop on a model that has
that hop's pair. Stand-ins for the served models: routing reads only their languages."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from tserve.service.settings import Settings
from tserve.service.translation.routing import routes_by_pair
from tserve.service.translation.served import ServedTranslator


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
