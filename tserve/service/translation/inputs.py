"""The rules a translation request meets before an engine sees it, whichever API it came by (`/v1/translations`,
the Open Inference Protocol, LibreTranslate's `/translate`, and the language choice of attention maps, the
logit lens and embeddings): how many inputs, each one's characters, max_tokens (the server's limit and the
model's), num_beams and n, the glossary, and the languages (as users write them, mapped to the model's codes).
Every rule is here and nowhere else; a broken one is an `InvalidInput` (400), which each API renders in its own
shape (`service.errors`). The served translator applies them and cuts what passes into documents ready to submit
(`ServedTranslator.check`, once per request and model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tserve.model.html_markup import Markup
from tserve.model.language_codes import model_code
from tserve.service.engine.translation_input import Languages
from tserve.service.errors import InvalidInput
from tserve.service.limits import check_input_chars, check_input_count, check_max_tokens

if TYPE_CHECKING:
    from tserve.model.checkpoint import LoadedModel
    from tserve.service.settings import Settings


class TranslatorLanguages(Protocol):
    """What the language rules read of a served translator: its name, its codes and its checkpoint's pair."""

    name: str
    loaded: LoadedModel

    @property
    def language_codes(self) -> list[str]: ...

MAX_BEAMS = 16  # num_beams and n
MAX_GLOSSARY_TERM_CHARS = 100


@dataclass
class TranslationAsk:
    """What a client asks of a translator, whichever API it came by."""

    texts: list[str]
    num_beams: int | None = None  # None: the checkpoint's
    max_tokens: int | None = None  # new tokens per sentence; None: the checkpoint's, within the model's limit
    n: int = 1  # alternatives per input
    glossary: dict[str, str] | None = None
    html: bool = False
    source_lang: str | None = None
    target_lang: str | None = None
    markups: list[Markup] | None = None  # files: their blocks (`texts` unused; sized by --max-file-bytes)
    cache: bool = True  # answer sentences the translation memory holds from it


def _integer(name: str, value: object, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise InvalidInput(f"{name} must be an integer {bound}; got {value!r}", f"invalid_{name}", name)


def check_count(count: int, settings: Settings) -> None:
    """One request's inputs: at least one, at most --max-prompts (checked before language detection too)."""
    if not count:
        raise InvalidInput("no input to translate", "empty_input")
    check_input_count(count, settings.max_prompts)


def check_options(ask: TranslationAsk, settings: Settings, max_target_len: int, default_beams: int) -> None:
    """The request's numbers against the server's limits and the model's."""
    check_count(len(ask.texts) if ask.markups is None else len(ask.markups), settings)
    if ask.num_beams is not None:
        _integer("num_beams", ask.num_beams, 1, MAX_BEAMS)
    _integer("n", ask.n, 1, MAX_BEAMS)
    beams = ask.num_beams or default_beams
    if ask.n > beams:
        raise InvalidInput(f"n {ask.n} exceeds num_beams {beams}: each alternative is a beam's hypothesis", "invalid_n",
                           "n")
    if ask.max_tokens is not None:
        _integer("max_tokens", ask.max_tokens, 1, None)
        check_max_tokens(ask.max_tokens, settings.max_tokens_limit)
        if ask.max_tokens > max_target_len:
            raise InvalidInput(f"max_tokens {ask.max_tokens} exceeds this model's limit of {max_target_len}",
                               "max_tokens_too_large")
    for i, text in enumerate(ask.texts):
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput(f"input {i} is empty", "empty_input")
        check_input_chars(text, settings.max_input_chars, f"input {i}")
    check_glossary(ask.glossary, settings.max_glossary_entries)


def check_glossary(glossary: dict[str, str] | None, max_entries: int) -> None:
    """At most `max_entries` (--max-glossary-entries) pairs of terms, each 1 to 100 characters and not blank. A
    sentence holding a source term is searched with at least 4 beams (`engine.translation_input.MIN_CONSTRAINED_BEAMS`)."""
    if not glossary:
        return
    if len(glossary) > max_entries:
        raise InvalidInput(f"the glossary has {len(glossary)} entries; the limit is {max_entries} "
                           "(--max-glossary-entries)", "invalid_glossary")
    for source, target in glossary.items():
        for term in (source, target):
            if not isinstance(term, str) or not term.strip() or len(term) > MAX_GLOSSARY_TERM_CHARS:
                raise InvalidInput(f"glossary terms must be 1 to {MAX_GLOSSARY_TERM_CHARS} characters and not "
                                   f"blank: {source!r} -> {target!r}", "invalid_glossary")


def resolve_languages(served: TranslatorLanguages, source: str | None, target: str | None) -> Languages | None:
    """The model's (source, target) codes for languages written as ISO 639-1 / 639-3 / BCP-47 or as its own
    codes: both required by a multilingual model (a tagged one, MADLAD-400, reads any source: the target only);
    for a one-pair model, checked against its pair (None)."""
    codes, name = served.language_codes, served.name
    for asked, side in ((source, "source_lang"), (target, "target_lang")):
        if asked is not None and (not isinstance(asked, str) or not asked.strip() or len(asked) > 35):
            raise InvalidInput(f"{side} must be a language code of at most 35 characters", "unsupported_language")
    if not codes:
        pair = served.loaded.languages
        for asked, have, side in ((source, pair and pair[0], "source"), (target, pair and pair[1], "target")):
            if asked is not None and have is not None and model_code(asked, [have]) is None:
                raise InvalidInput(f"model {name!r} translates {pair[0]} to {pair[1]}; {side} language "
                                   f"{asked!r} is not its {side}", "unsupported_language")
        return None
    tagged = served.loaded.tokenizer.target_tagged
    resolved: list[str | None] = []
    for asked, side in ((source, "source_lang"), (target, "target_lang")):
        if asked is None and tagged and side == "source_lang":
            resolved.append(None)
            continue
        if asked is None:
            raise InvalidInput(f"model {name!r} is multilingual: give {side} (one of {', '.join(codes)}, "
                               f"or ISO 639 / BCP-47 codes of them)", "missing_language")
        code = model_code(asked, codes)
        if code is None:
            raise InvalidInput(f"{side} {asked!r} is not a language of model {name!r}; its languages: "
                               f"{', '.join(codes)}", "unsupported_language")
        resolved.append(code)
    return resolved[0], resolved[1]


def resolve_source(served: TranslatorLanguages, source: str) -> str | None:
    """The model's code for a source language alone (embeddings): checked against a one-pair model's source
    (None), mapped to a multilingual model's code."""
    if not served.language_codes:
        resolve_languages(served, source, None)
        return None
    code = model_code(source, served.language_codes)
    if code is None:
        raise InvalidInput(f"source_lang {source!r} is not a language of model {served.name!r}; its languages: "
                           f"{', '.join(served.language_codes)}", "unsupported_language")
    return code
