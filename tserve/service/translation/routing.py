"""Which served translators a language pair goes through, and how a text goes through two of them.

`translators_by_pair`: every pair a served translator has (a one-pair model before a multilingual one unless
--prefer-multilingual). `routes_by_pair`: those, and the pairs no model has that two chain through
--pivot-language (default English). `translate_route`: a request through its route; over two hops each
sentence's second hop is submitted as soon as its first has finished, so both run inside the models'
running batches and a document's first sentences are in the second model while the rest are in the first.
Pairs are written in LibreTranslate's codes (ISO 639-1 where a language has one; `model.language_codes`)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, replace

from fastapi import Request

from tserve.model.html_markup import parse_html
from tserve.model.language_codes import model_code, short_code
from tserve.service.connection import while_connected
from tserve.service.errors import bad_request, engine_failure
from tserve.service.registry import ModelRegistry
from tserve.service.translation.inputs import TranslationAsk
from tserve.service.translation.languages import LanguageDetector
from tserve.service.translation.served import (
    SegmentResult,
    ServedTranslator,
    TranslationOutput,
    assemble,
    weighted_score,
)

Pair = tuple[str, str]
Hop = tuple[ServedTranslator, Pair]  # a translator and the pair it translates in that hop


# A multilingual model's pairs are tens of thousands: worked out once per set of served models
# (`ModelRegistry.derived`), not per request.
def translators_by_pair(reg: ModelRegistry) -> dict[Pair, ServedTranslator]:
    """(source, target) -> the translator that serves it: a one-pair model (opus-mt) before a multilingual one
    (NLLB: every ordered pair of its languages) unless --prefer-multilingual; of two of a kind, the first named."""
    return reg.derived("translators_by_pair", lambda: _translators_by_pair(reg))


def _translators_by_pair(reg: ModelRegistry) -> dict[Pair, ServedTranslator]:
    pairs: dict[Pair, ServedTranslator] = {}
    one_pair = [m for m in reg.models.values() if isinstance(m, ServedTranslator) and m.loaded.languages is not None]
    multilingual = [m for m in reg.models.values() if isinstance(m, ServedTranslator) and m.language_codes]
    for served in (multilingual + one_pair) if reg.settings.prefer_multilingual else (one_pair + multilingual):
        if served.loaded.languages is not None:
            pairs.setdefault(served.loaded.languages, served)
            continue
        codes = list(dict.fromkeys(short_code(c) for c in served.language_codes))
        for source in codes:
            for target in codes:
                if source != target:
                    pairs.setdefault((source, target), served)
    return pairs


def routes_by_pair(reg: ModelRegistry) -> dict[Pair, tuple[Hop, ...]]:
    """Every reachable pair's hops: the translator that serves it (`translators_by_pair`), else two through
    --pivot-language (source→pivot, pivot→target) when two translators chain there."""
    return reg.derived("routes_by_pair", lambda: _routes_by_pair(reg))


def _routes_by_pair(reg: ModelRegistry) -> dict[Pair, tuple[Hop, ...]]:
    direct = translators_by_pair(reg)
    routes = {pair: ((served, pair),) for pair, served in direct.items()}
    pivot = reg.settings.pivot_language
    # Indexed by the pivot's side: with a multilingual model the pairs are tens of thousands.
    into = {source: served for (source, target), served in direct.items() if target == pivot}
    out_of = {target: served for (source, target), served in direct.items() if source == pivot}
    for source, first in into.items():
        for target, second in out_of.items():
            if source != target and (source, target) not in routes:
                routes[(source, target)] = ((first, (source, pivot)), (second, (pivot, target)))
    return routes


def pair_list(pairs: dict[Pair, object]) -> str:
    return ", ".join(f"{s}→{t}" for s, t in sorted(pairs)) or "none"


detector = LanguageDetector()  # one for every route that detects (its model loads on first use)


def shown_text(page: str) -> str:
    """An HTML page's text as a browser shows it (its blocks' text), what its language is detected on: its tags and
    attributes' names are English whatever the page's language."""
    return " ".join(block.text for block in parse_html(page).blocks)


async def detect_languages(texts: list[str], candidates: list[str], html: bool = False) -> list[tuple[str, float]]:
    """Each text's (each HTML page's, with `html`) most likely language among `candidates` and its confidence
    (0-100). Off the event loop: the first call loads the detector's model (about half a second)."""
    def rank() -> list[tuple[str, float]]:
        return [detector.rank(shown_text(t) if html else t, candidates)[0] for t in texts]

    return await asyncio.to_thread(rank)


async def pick_route(reg: ModelRegistry, texts: list[str], source: str | None, target: str | None,
                     html: bool = False) -> tuple[Hop, ...]:
    """The route of a request that names no model: its pair, the source detected from the texts when not given,
    the target the only one the source translates into directly when not given (the bundled English → German
    and German → English answer either language that way)."""
    routes = routes_by_pair(reg)
    if source is None:
        sample = " ".join(shown_text(t) for t in texts) if html else " ".join(texts)
        (source, _), = await detect_languages([sample[:2000]], sorted({s for s, _ in routes}))
    if target is None:
        codes = sorted({c for pair in routes for c in pair})
        code = model_code(source, codes) or source
        targets = sorted({t for (s, t), hops in routes.items() if s == code and len(hops) == 1})
        if len(targets) != 1:
            raise bad_request(f"several translators are served: give 'model', or target_lang (the source, {code}, "
                              f"translates into {', '.join(targets) or 'nothing served'})", "model_required")
        target = targets[0]
    return route_for(reg, source, target)


def route_for(reg: ModelRegistry, source: str, target: str) -> tuple[Hop, ...]:
    """The hops of a pair written as users write languages (`de`, `deu`, `de-DE`); a 400 naming the served
    pairs when none reaches it."""
    routes = routes_by_pair(reg)
    codes = sorted({c for pair in routes for c in pair})
    pair = (model_code(source, codes) or source, model_code(target, codes) or target)
    if pair not in routes:
        raise bad_request(f"{source}→{target} is not served (served: {pair_list(routes)})", "unsupported_pair")
    return routes[pair]


def hop_ask(ask: TranslationAsk, hops: tuple[Hop, ...], k: int, texts: list[str]) -> TranslationAsk:
    """What hop k of a route is asked: its own pair; alternatives on the last hop only, the checkpoint's beams
    before it. A glossary's source terms are in the request's source language and its target terms in the final
    one: through a pivot, the first hop places the target term of each source term it finds (verbatim, in the
    pivot language's text) and the last hop keeps what the first placed, so that a term goes through as written."""
    served, (source, target) = hops[k]
    glossary = ask.glossary
    if glossary and len(hops) > 1 and k:
        glossary = {term: term for term in glossary.values()}
    if k == len(hops) - 1:
        return replace(ask, texts=texts, source_lang=source, target_lang=target, glossary=glossary)
    return TranslationAsk(texts, None, ask.max_tokens, 1, glossary, ask.html, source, target, cache=ask.cache)


@dataclass
class RouteResult:
    outputs: list[TranslationOutput]  # one per text
    prompt_tokens: int  # the sources' tokens, as the first hop read them
    completion_tokens: int  # every hop's generated tokens


async def translate_route(request: Request, hops: tuple[Hop, ...], ask: TranslationAsk) -> RouteResult:
    """Each text of `ask` through the route's hops. One hop: the model's own translation. Two: sentence by
    sentence, each submitted to the second hop as soon as the first has finished it (an HTML page goes
    through each hop whole, its markup placed by each model)."""
    # The request against every hop's model once, before any work: not a 400 after the first hop.
    languages = [hop[0].check(hop_ask(ask, hops, k, ask.texts)) for k, hop in enumerate(hops)]
    if len(hops) == 1 or ask.html:
        texts, prompt, completion = ask.texts, 0, 0
        for k, hop in enumerate(hops):
            last = k == len(hops) - 1
            docs = hop[0].documents(hop_ask(ask, hops, k, texts), languages[k])
            prompt = prompt or sum(len(j.source_ids) for d in docs for j in d.jobs)
            outs = await hop[0].translate(request, docs, ask.n if last else 1, cache=ask.cache)
            completion += sum(len(o.token_ids) for o in outs)
            texts = [o.text for o in outs]
        return RouteResult(outs, prompt, completion)
    (first, _), (second, _) = hops  # a route is one hop or two
    docs = first.documents(hop_ask(ask, hops, 0, ask.texts), languages[0])
    turns = [turn for d in docs for turn in range(len(d.jobs))]  # each sentence's place in its document
    first_tokens: list[int] = []
    second_hop = object()  # every second-hop sentence is part of one client request there too

    async def onwards(k: int, seg: SegmentResult) -> TranslationOutput:
        """Sentence k's second hop, submitted once the first has translated it; both hops answer from their
        translation memories what they hold (`results_as_ready`, the one way a translator's segments go)."""
        first_tokens.append(len(seg.token_ids))
        if not seg.text.strip():  # nothing came out of the first hop: nothing goes on
            return TranslationOutput("", [], seg.hypotheses[0].score, seg.finish_reason, [("", 0.0)])
        (doc,) = second.documents(hop_ask(ask, hops, 1, [seg.text]), languages[1])
        results: list[SegmentResult | None] = [None] * len(doc.jobs)
        async with aclosing(second.results_as_ready([doc], ask.cache, second_hop, turns[k])) as ready:
            async for i, result in ready:
                results[i] = result
        return assemble(doc, results, ask.n)

    async def both_hops() -> list[TranslationOutput]:
        pending: dict[int, asyncio.Future] = {}
        try:
            async with aclosing(first.results_as_ready(docs, ask.cache)) as ready:
                async for k, seg in ready:
                    pending[k] = asyncio.ensure_future(onwards(k, seg))
            return list(await asyncio.gather(*(pending[k] for k in range(len(turns)))))
        finally:
            for task in pending.values():
                task.cancel()

    try:
        sentences = await while_connected(request, both_hops())
    except Exception as exc:
        raise engine_failure(exc, "translation") from exc
    outputs, start = [], 0
    for doc in docs:
        mine = sentences[start: start + len(doc.jobs)]
        start += len(doc.jobs)
        outputs.append(_joined(doc, mine, ask.n))
    prompt = sum(len(j.source_ids) for d in docs for j in d.jobs)
    return RouteResult(outputs, prompt, sum(first_tokens) + sum(len(o.token_ids) for o in outputs))


def _joined(doc, sentences: list[TranslationOutput], n: int) -> TranslationOutput:  # noqa: ANN001 - DocumentJob
    """A document's sentences, translated over the route, back in its layout; alternative k takes each
    sentence's k-th (its last where it has fewer)."""
    results = [SegmentResult(s.text, s.token_ids, [], s.finish_reason) for s in sentences]
    alternatives: dict[str, float] = {}
    for k in range(max(len(s.alternatives) for s in sentences) if n > 1 else 1):
        picks = [s.alternatives[min(k, len(s.alternatives) - 1)] for s in sentences]
        text = doc.document.join([t for t, _ in picks])
        alternatives.setdefault(text, weighted_score([(score, max(1, len(t.split()))) for t, score in picks]))
    ranked = list(alternatives.items())
    text, _ = ranked[0]
    score = weighted_score([(s.score, len(s.token_ids)) for s in sentences])
    return TranslationOutput(text, [t for r in results for t in r.token_ids], score,
                             "length" if any(s.finish_reason == "length" for s in sentences) else "stop",
                             [(text, score)] + [a for a in ranked[1:n]])
