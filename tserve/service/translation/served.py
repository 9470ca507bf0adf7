"""Translation (encoder-decoder): the continuous-batching engine with beams; attention maps of a source and
a target (by default the model's own translation, exactly what `/v1/translations` answers); the Open
Inference Protocol's BYTES text in and out."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import Request

from tserve.model import attention_maps as am
from tserve.model.alignment import SentencePair, token_spans, word_alignment
from tserve.model.decoding.constrained_beam import ConstraintsUnmet
from tserve.model.embeddings import embed_token_lists
from tserve.model.html_markup import Block, render_block, tag_placements, words
from tserve.model.segmentation import Document
from tserve.model.tokenizer import Tokenizer
from tserve.service.connection import while_connected
from tserve.service.engine import Event, QueueFull, SegmentRequest, TranslationEngine
from tserve.service.engine.output import Hypothesis
from tserve.service.engine.translation_input import DocumentJob, Languages
from tserve.service.errors import InvalidInput, OIPError, bad_request, engine_failure
from tserve.service.schemas import AttentionRequest
from tserve.service.served import AttentionResult, ServedModel, bytes_elements
from tserve.service.translation.inputs import TranslationAsk, check_options, resolve_languages, resolve_source
from tserve.service.translation.memory import StoredHypothesis, memory_key, shared_memory, weights_hash

log = logging.getLogger("tserve.translation")

_OIP_PARAMETERS = {"n", "num_beams", "glossary", "source_lang", "target_lang"}


@dataclass
class SegmentResult:
    text: str
    token_ids: list[int]
    hypotheses: list[Hypothesis]  # best first (beams: every finished one; greedy: its output)
    finish_reason: str


@dataclass
class TranslationOutput:
    """One input's answer: the segments' translations joined into the input's layout."""

    text: str
    token_ids: list[int]  # every segment's, in order
    score: float  # token-weighted mean of the segments' scores
    finish_reason: str  # "length" when any segment stopped at its length limit
    alternatives: list[tuple[str, float]]  # best first, distinct; the first is (text, score)
    segments: list[dict] | None = None  # alignment_report, when asked for


async def collect_translation(engine: TranslationEngine, req: SegmentRequest) -> SegmentResult:
    """The text, ids and hypotheses of one translation request, once it has finished."""
    text, ids = "", []
    async for event in engine.stream(req):
        text += event.text
        ids += event.token_ids
    return SegmentResult(text, ids, event.result, event.finish_reason)


def weighted_score(parts: list[tuple[float, int]]) -> float:
    """Mean of segment scores weighted by their token counts."""
    tokens = sum(max(n, 1) for _, n in parts)
    return sum(score * max(n, 1) for score, n in parts) / tokens


def alternative_picks(segments: list[SegmentResult], n: int) -> list[list[Hypothesis]]:
    """Up to `n` alternatives as one hypothesis per segment: alternative k takes each segment's k-th best
    distinct hypothesis (its last one where it has fewer); the first is every segment's best."""
    options = []
    for seg in segments:
        distinct: dict[str, Hypothesis] = {}
        for h in seg.hypotheses:
            distinct.setdefault(h.text, h)
        options.append(list(distinct.values()))
    best = [Hypothesis(seg.text, seg.token_ids, seg.hypotheses[0].score) for seg in segments]
    return [best] + [[o[min(k, len(o) - 1)] for o in options] for k in range(1, max(map(len, options)) if n > 1 else 1)]


def assemble(doc: DocumentJob, segments: list[SegmentResult], n: int,
             render: Callable[[list[Hypothesis]], str] | None = None) -> TranslationOutput:
    """The document's translation and up to `n` distinct alternatives (`alternative_picks`), each joined into
    the document's layout, or made by `render` (an HTML page's markup around its blocks' translations)."""
    render = render or (lambda picks: doc.document.join([h.text for h in picks]))
    alternatives: dict[str, float] = {}
    for picks in alternative_picks(segments, n):
        alternatives.setdefault(render(picks), weighted_score([(h.score, len(h.token_ids)) for h in picks]))
    ranked = list(alternatives.items())
    (best_text, score) = ranked[0]
    return TranslationOutput(best_text, [t for seg in segments for t in seg.token_ids], score,
                             "length" if any(seg.finish_reason == "length" for seg in segments) else "stop",
                             ranked[:n])


def _key(picks: list[Hypothesis]) -> tuple:
    return tuple((h.text, tuple(h.token_ids)) for h in picks)


def sentence_pairs(doc: DocumentJob, picks: list[Hypothesis], tokenizer: Tokenizer, eos: int,
                   every: bool = False) -> list[SentencePair | None]:
    """Per sentence of a document, what aligning its translation `picks[i]` takes; in an HTML page's blocks
    without markup (which need no alignment to render) None, unless `every`."""
    pairs: list[SentencePair | None] = []
    sentences = zip(doc.jobs, doc.document.segments, picks, strict=True)
    needed = ([bool(block.children) for block, bdoc in zip(doc.markup.blocks, doc.blocks, strict=True)
               for _ in bdoc.segments] if doc.markup is not None else [True] * len(doc.jobs))
    for (job, source, pick), need in zip(sentences, needed, strict=True):
        if not (need or every):
            pairs.append(None)
            continue
        target_ids = [t for t in pick.token_ids if t != eos]
        pairs.append(SentencePair(job.source_ids, target_ids, token_spans(tokenizer, job.source_ids, source),
                                  token_spans(tokenizer, target_ids, pick.text), words(source), words(pick.text)))
    return pairs


@dataclass
class BlockAlignment:
    """An HTML block, its translation, and which source word each target word was read from (-1: none)."""

    block: Block
    target: str
    source_words: list[tuple[int, int]]  # (start, end) in block.text
    target_words: list[tuple[int, int]]  # ... in target
    aligned: list[int]


def block_alignments(doc: DocumentJob, picks: list[Hypothesis],
                     aligned: list[list[int] | None]) -> list[BlockAlignment]:
    """Each block of an HTML page with its translation (its sentences' `picks`, joined in the block's layout)
    and its sentences' word alignments put end to end."""
    out, i = [], 0
    for block, bdoc in zip(doc.markup.blocks, doc.blocks, strict=True):
        m = len(bdoc.segments)
        texts = [h.text for h in picks[i: i + m]]
        source_words, target_words, block_aligned = [], [], []
        src_at, tgt_at = len(bdoc.layout[0]), len(bdoc.layout[0])
        for source, text, after, a in zip(bdoc.segments, texts, bdoc.layout[1:], aligned[i: i + m], strict=True):
            base = len(source_words)
            source_words += words(source, src_at)
            tw = words(text, tgt_at)
            target_words += tw
            block_aligned += [-1] * len(tw) if a is None else [x + base if x >= 0 else -1 for x in a]
            src_at += len(source) + len(after)
            tgt_at += len(text) + len(after)
        out.append(BlockAlignment(block, bdoc.join(texts), source_words, target_words, block_aligned))
        i += m
    return out


def render_html(doc: DocumentJob, picks: list[Hypothesis], aligned: list[list[int] | None]) -> str:
    """The page with each block's translation and its markup placed by the sentences' word alignments."""
    return doc.markup.join([render_block(b.block, b.target, b.target_words, b.source_words, b.aligned)
                            for b in block_alignments(doc, picks, aligned)])


def _segment(source: str, target: str, source_words: list[tuple[int, int]], target_words: list[tuple[int, int]],
             aligned: list[int]) -> dict[str, Any]:
    return {"source": source, "translation": target, "source_words": [source[s:e] for s, e in source_words],
            "target_words": [target[s:e] for s, e in target_words], "alignment": aligned}


def alignment_report(doc: DocumentJob, picks: list[Hypothesis], aligned: list[list[int] | None]) -> list[dict]:
    """What `return_alignment` answers: per segment (a sentence; an HTML page's block) its words, the source
    word each target word was read from, and, for HTML, where each inline tag went."""
    if doc.markup is None:
        return [_segment(source, h.text, words(source), words(h.text), a or [])
                for source, h, a in zip(doc.document.segments, picks, aligned, strict=True)]
    return [_segment(b.block.text, b.target, b.source_words, b.target_words, b.aligned)
            | {"tags": [asdict(t) for t in tag_placements(b.block, b.source_words, b.aligned)]}
            for b in block_alignments(doc, picks, aligned)]


class TranslationRun:
    """A client request's segments under way (`ServedTranslator.start`): what the translation memory held, and
    the engine's requests for the rest. Read it once, `as_ready()` (any order), `in_order()` or, for one greedy
    segment, `events()` as it is decoded; whichever ends the reading cancels what is left, and a reading that
    finishes stores what the engine translated to the end ("stop") in the memory."""

    def __init__(self, served: ServedTranslator, keys: list[str], remembered: dict[int, SegmentResult],
                 submitted: dict[int, SegmentRequest]) -> None:
        self.served, self.keys, self.remembered, self.submitted = served, keys, remembered, submitted

    async def as_ready(self) -> AsyncIterator[tuple[int, SegmentResult]]:
        """(k, result) for every segment (k counts them across the documents, in order), each as soon as it is
        ready: the memory's at once, the rest as the engine finishes them."""
        engine = self.served.engine
        pending = {asyncio.ensure_future(collect_translation(engine, r)): k for k, r in self.submitted.items()}
        finished: list[tuple[int, SegmentResult]] = []
        try:
            for k, result in self.remembered.items():
                yield k, result
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    k = pending.pop(task)
                    finished.append((k, task.result()))
                    yield finished[-1]
        finally:
            for task in pending:
                task.cancel()
            self._cancel()
        await self._store(finished)

    async def in_order(self) -> AsyncIterator[SegmentResult]:
        """Every segment's result in order, each once it and those before it are ready (they decode side by
        side)."""
        ready: dict[int, SegmentResult] = {}
        next_k = 0
        async with aclosing(self.as_ready()) as results:
            async for k, result in results:
                ready[k] = result
                while next_k in ready:
                    yield ready.pop(next_k)
                    next_k += 1

    async def events(self) -> AsyncIterator[Event]:
        """One greedy segment's events as it is decoded; the memory's answer is one event."""
        if self.remembered:
            (result,) = self.remembered.values()
            yield Event(result.text, result.token_ids, finish_reason="stop", result=result.hypotheses)
            return
        ((k, req),) = self.submitted.items()
        event = None
        try:
            async for event in self.served.engine.stream(req):
                yield event
        finally:
            self._cancel()
        if event is not None:
            await self._store([(k, SegmentResult("", event.token_ids, event.result, event.finish_reason))])

    def _cancel(self) -> None:
        for req in self.submitted.values():
            req.cancel()

    async def _store(self, results: list[tuple[int, SegmentResult]]) -> None:
        memory = self.served.memory
        if not self.keys or memory is None:  # the memory is off, or this request asked not to use it
            return
        finished = {self.keys[k]: [StoredHypothesis(h.text, h.token_ids, h.score) for h in r.hypotheses]
                    for k, r in results if r.finish_reason == "stop"}
        await asyncio.to_thread(memory.put_many, finished)  # in a thread: a write may wait on another process
        self.served.metrics.memory_entries.set(len(memory))


class ServedTranslator(ServedModel):
    embeds = "text"
    task = "translation"
    has_logit_lens = True
    scores_targets = True
    generated_attention_modules = 2  # decoder.self and decoder.cross

    def build_worker(self) -> TranslationEngine:
        s = self.settings
        self.engine = TranslationEngine(self.name, self.loaded, max_rows=s.max_running_requests,
                                        max_queue=s.max_queue, timeout_s=s.request_timeout_s, metrics=self.metrics,
                                        cuda_graphs=s.cuda_graphs, max_len=s.max_model_len,
                                        reuse_sources=s.prefix_cache, kv_cache_budget=s.kv_cache_budget,
                                        kv_block_size=s.kv_block_size, async_scheduling=s.async_scheduling)
        self.build_embedder(lambda ids: list(embed_token_lists(self.loaded, ids).cpu()))
        self.engine.reserved_rows = min(s.reserved_rows, s.max_running_requests - 1)
        self.memory = shared_memory(s.translation_memory, s.translation_memory_max_entries)
        if self.memory is not None:  # the translations depend on the weights and how they are held
            files = sorted(p for p in self.loaded.path.iterdir() if p.suffix in (".safetensors", ".json"))
            options = "".join(f"/{k}={v}" for k, v in sorted(self.loaded.quantization_options.items()))
            self.weights_hash = f"{weights_hash(files)}/{self.loaded.quantization}/{self.loaded.dtype}{options}"
            self.metrics.memory_entries.set(len(self.memory))  # what a file of an earlier run holds, from the start
        return self.engine

    def warm_up(self) -> None:
        self.engine.warm_up()

    def card_fields(self) -> dict[str, Any]:
        pair = self.loaded.languages
        return {"languages": {"source": pair[0], "target": pair[1]} if pair else None,
                "language_codes": self.language_codes or None}

    @property
    def language_codes(self) -> list[str]:
        """A multilingual translator's language codes (NLLB's `deu_Latn`); empty for a one-pair model."""
        return list(self.loaded.tokenizer.language_codes)

    def checked_documents(self, ask: TranslationAsk) -> list[DocumentJob]:
        """The request checked once (`check`) and cut into document jobs (`documents`)."""
        return self.documents(ask, self.check(ask))

    def check(self, ask: TranslationAsk) -> Languages | None:
        """The request's rules against this model, through the one validator (`service.translation.inputs`:
        `check_options`, `resolve_languages`), once per request and model: its languages, or the HTTP error
        (400) in the shape of the API that asked."""
        try:
            check_options(ask, self.settings, self.engine.translator.max_target_len,
                          self.loaded.generation.num_beams)
            return resolve_languages(self, ask.source_lang, ask.target_lang)
        except InvalidInput as exc:
            raise engine_failure(exc, "translation", "invalid_value") from exc

    def documents(self, ask: TranslationAsk, languages: Languages | None) -> list[DocumentJob]:
        """A request `check` passed (its `languages`), cut into a document job per input (with `html`, per page)
        whose sentences each fit the model; the HTTP error for what only the cutting finds (a sentence too long,
        a page without text: 400; glossary terms that cannot be placed: 422)."""
        translator = self.engine.translator
        try:
            if ask.markups is not None:
                return [translator.markup_document(m, ask.num_beams, ask.max_tokens, ask.glossary, languages)
                        for m in ask.markups]
            make = translator.html_document if ask.html else translator.document
            docs = []
            for i, text in enumerate(ask.texts):
                try:
                    docs.append(make(text, ask.num_beams, ask.max_tokens, ask.glossary, languages))
                except InvalidInput as exc:
                    raise InvalidInput(f"input {i}: {exc}", exc.code or "input_too_long") from exc
            return docs
        except (InvalidInput, ConstraintsUnmet) as exc:
            raise engine_failure(exc, "translation", "invalid_value") from exc

    async def start(self, docs: list[DocumentJob], cache: bool = True, group: object | None = None,
                    first_turn: int = 0) -> TranslationRun:
        """Every segment of `docs` under way: those the translation memory holds (unless `cache` is off) answered
        from it, the rest submitted as one client request (with `group`, of the client request that group already
        stands for, from turn `first_turn`); raises what the engine's submission raises (QueueFull, ValueError),
        before anything is under way. The one way a translator's segments go: non-streaming, streaming, files and
        both hops of a pivot take it."""
        jobs = [(d, i) for d in docs for i in range(len(d.jobs))]
        memory = self.memory if cache else None
        keys = [self.memory_key(d, i) for d, i in jobs] if memory is not None else []
        found = await asyncio.to_thread(memory.get_many, keys) if memory is not None else {}
        todo = [k for k in range(len(jobs)) if not keys or keys[k] not in found]
        if memory is not None:  # per sentence: a request or file that holds one twice counts it twice
            self.metrics.memory_hits.labels(self.name).inc(len(keys) - len(todo))
            self.metrics.memory_misses.labels(self.name).inc(len(todo))
        reqs = self.engine.submit_all([jobs[k][0].jobs[jobs[k][1]] for k in todo], one_request=True, group=group,
                                      first_turn=first_turn) if todo else []
        remembered = {}
        for k, key in enumerate(keys):
            if key in found:
                hyps = [Hypothesis(h.text, list(h.token_ids), h.score) for h in found[key]]
                remembered[k] = SegmentResult(hyps[0].text, hyps[0].token_ids, hyps, "stop")
        return TranslationRun(self, keys, remembered, dict(zip(todo, reqs, strict=True)))

    async def results_as_ready(self, docs: list[DocumentJob], cache: bool = True, group: object | None = None,
                               first_turn: int = 0) -> AsyncIterator[tuple[int, SegmentResult]]:
        """`start`, then (k, result) for every segment as soon as it is ready (`TranslationRun.as_ready`): close it
        at once with `contextlib.aclosing`. Engine failures are raised as they are (`engine_failure` maps them)."""
        run = await self.start(docs, cache, group, first_turn)
        async with aclosing(run.as_ready()) as ready:
            async for item in ready:
                yield item

    async def segment_results(self, request: Request | None, docs: list[DocumentJob], cache: bool = True,
                              on_done: Callable[[], None] | None = None) -> list[list[SegmentResult]]:
        """Each document's sentences translated (`results_as_ready`); `on_done()` is called as each sentence is
        ready. A client that leaves (or a cancelled file job) cancels them."""
        results: list[SegmentResult | None] = [None] * sum(len(d.jobs) for d in docs)

        async def collect() -> None:
            async with aclosing(self.results_as_ready(docs, cache)) as ready:
                async for k, result in ready:
                    results[k] = result
                    if on_done is not None:
                        on_done()

        try:
            await while_connected(request, collect())
        except Exception as exc:
            raise engine_failure(exc, "translation") from exc
        per_doc, start = [], 0
        for d in docs:
            per_doc.append(results[start: start + len(d.jobs)])
            start += len(d.jobs)
        return per_doc

    def memory_key(self, doc: DocumentJob, i: int) -> str:
        """What a sentence's translation depends on: the model and its weights, the languages, the decoding
        options and the sentence as the model reads it (its source ids)."""
        job = doc.jobs[i]
        options = {"num_beams": job.num_beams, "max_new_tokens": job.max_new_tokens, "constraints": job.constraints,
                   "forced_first_token": job.forced_first_token}
        languages = doc.languages or self.loaded.languages or (None, None)
        return memory_key(self.name, self.weights_hash, languages[0], languages[1], options, job.source_ids)

    async def stream(self, docs: list[DocumentJob], cache: bool = True) -> TranslationRun:
        """A streamed translation's segments under way (`start`), or the HTTP error when the engine refuses them
        (429 when the queue is full), before the response starts."""
        try:
            return await self.start(docs, cache)
        except (QueueFull, ValueError) as exc:
            raise engine_failure(exc, "translation") from exc

    async def translate(self, request: Request, docs: list[DocumentJob], n: int = 1,
                        alignment: bool = False, cache: bool = True) -> list[TranslationOutput]:
        """Each document's translation, as `/v1/translations` answers it (with `alignment`, its best
        translation's `alignment_report`); a client that leaves cancels it."""
        per_doc = await self.segment_results(request, docs, cache)
        aligned = await self.word_alignments(request, docs, per_doc, n, alignment)

        def renderer(i: int) -> Callable[[list[Hypothesis]], str] | None:
            if docs[i].markup is None:
                return None
            return lambda picks: render_html(docs[i], picks, aligned[(i, _key(picks))])

        outputs = []
        for i, (d, r) in enumerate(zip(docs, per_doc, strict=True)):
            out = assemble(d, r, n, renderer(i))
            if alignment:
                best = alternative_picks(r, n)[0]
                out.segments = alignment_report(d, best, aligned[(i, _key(best))])
            outputs.append(out)
        return outputs

    async def translate_blocks(self, doc: DocumentJob, escape: Callable[[str], str] | None, cache: bool = True,
                               on_done: Callable[[], None] | None = None) -> list[str]:
        """A file's blocks (one document job, no client waiting on it) rendered in the target language, each
        block's markup placed by its sentences' word alignments."""
        start = time.perf_counter()
        (results,) = await self.segment_results(None, [doc], cache, on_done)
        translated = time.perf_counter()
        aligned = await self.word_alignments(None, [doc], [results], 1, False)
        picks = alternative_picks(results, 1)[0]
        rendered = [render_block(b.block, b.target, b.target_words, b.source_words, b.aligned, escape)
                    for b in block_alignments(doc, picks, aligned[(0, _key(picks))])]
        log.info("file blocks translated", extra={"model": self.name, "sentences": len(doc.jobs),
                                                  "translate_s": round(translated - start, 3),
                                                  "align_s": round(time.perf_counter() - translated, 3)})
        return rendered

    async def word_alignments(self, request: Request | None, docs: list[DocumentJob], results: list[list[SegmentResult]],
                              n: int, report: bool) -> dict[tuple[int, tuple], list[list[int] | None]]:
        """(document, alternative's key) -> its sentences' word alignments (None where not needed): every
        alternative of every HTML page (to place its markup) and, with `report`, every document's best; all
        in one call job of the engine's worker."""
        tok, eos = self.loaded.tokenizer, self.loaded.config.eos_token_id
        wanted: list[tuple[int, tuple, list[SentencePair | None]]] = []  # (document, alternative's key, pairs)
        for i, (d, r) in enumerate(zip(docs, results, strict=True)):
            picks = alternative_picks(r, n)
            if d.markup is None and report:
                picks = picks[:1]
            elif d.markup is None:
                continue
            wanted += [(i, _key(p), sentence_pairs(d, p, tok, eos, every=report and k == 0))
                       for k, p in enumerate(picks)]
        pairs = [p for _, _, ps in wanted for p in ps if p is not None]
        aligned = iter(await self.call(request, "translation", "invalid_request", word_alignment,
                                       self.loaded, pairs) if pairs else [])
        out: dict[tuple[int, tuple], list[list[int] | None]] = {}
        for i, key, ps in wanted:
            found = [None if p is None else next(aligned) for p in ps]
            out.setdefault((i, key), found)
        return out

    # ----------------------------------------------------------------------------------------------
    async def attention_context(self, request: Request, body: AttentionRequest) -> list[int] | None:
        """Without a target: the model's own translation of the input, from the engine like any other."""
        if body.target is not None or not body.input or not body.input.strip():
            return None
        try:
            languages = resolve_languages(self, body.source_lang, body.target_lang)
            self.source_ids(body.input, languages)
            job = self.engine.translator.job(body.input, None, None, languages)
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_attention_request") from exc
        doc = DocumentJob(Document([body.input], ["", ""]), [job])
        return (await self.translate(request, [doc]))[0].token_ids

    def embedding_ids(self, text: str, source_lang: str | None = None) -> list[int]:
        if source_lang is None:
            return self.text_ids(text)
        code = resolve_source(self, source_lang)
        if code is None or self.loaded.tokenizer.target_tagged:  # a tagged model's tag names a target
            return self.text_ids(text)
        return self.source_ids(text, (code, code))

    def source_ids(self, text: str | None, languages: Languages | None) -> list[int]:
        """A source's ids within the model's length (in its language, for a multilingual model)."""
        if languages is None or not text or not text.strip():
            return self.text_ids(text)
        ids = self.engine.translator.encode_source(text, languages)
        if len(ids) > self.loaded.config.max_source_len:
            raise InvalidInput(f"the input has {len(ids)} tokens; this model takes at most "
                               f"{self.loaded.config.max_source_len}")
        return ids

    def pair_ids(self, body: Any, own_translation: list[int] | None) -> tuple[list[int], list[int]]:
        """The source's ids and the target's (the model's own translation, or `body.target`), eos left out."""
        languages = resolve_languages(self, body.source_lang, body.target_lang)
        src = self.source_ids(body.input, languages)
        if own_translation is not None:
            return src, [t for t in own_translation if t != self.loaded.config.eos_token_id]
        return src, self.engine.translator.encode_target(body.target or "", languages)

    def attention_maps(self, body: AttentionRequest, own_translation: list[int] | None) -> AttentionResult:
        tok = self.loaded.tokenizer
        src, target_ids = self.pair_ids(body, own_translation)
        self.bound_weights(body, len(src), len(target_ids))
        maps = am.translation_attention_ids(self.loaded, src, target_ids, body.layers, body.heads)
        target = body.target if own_translation is None else tok.decode(target_ids)
        return AttentionResult(maps, extra={"target": target})

    def lens_inputs(self, body: Any, own_translation: list[int] | None) -> tuple[list[int], list[int] | None]:
        """The decoder's inputs: the start token, then the target (by default the model's own translation)."""
        cfg = self.loaded.config
        src, target = self.pair_ids(body, own_translation)
        if len(target) + 1 > cfg.max_target_len:
            raise InvalidInput(f"the target has {len(target)} tokens; this model takes at most "
                               f"{cfg.max_target_len - 1}", "invalid_lens_request")
        return [cfg.decoder_start_token_id, *target], src

    # ----------------------------------------------------------------------------------------------
    def oip_metadata(self) -> dict[str, Any]:
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
                "outputs": [{"name": "translation", "datatype": "BYTES", "shape": [-1]},
                            {"name": "score", "datatype": "FP32", "shape": [-1]},
                            {"name": "alternatives", "datatype": "BYTES", "shape": [-1, -1]}]}

    async def oip_infer(self, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
        """Parameters: `n` (integer), `num_beams` (integer), `glossary` (a JSON object in a string),
        `source_lang` and `target_lang` (as /v1/translations takes them). Outputs:
        `translation` [len], `score` [len] and, with n > 1, `alternatives` [len, n] (best first; "" where an
        input has fewer distinct ones)."""
        texts = bytes_elements(tensor, self.settings.max_prompts)
        params = tensor.get("parameters") or {}
        if unknown := sorted(set(params) - _OIP_PARAMETERS):  # as the language models refuse them: never ignored
            raise OIPError(400, f"unknown parameter {unknown[0]!r}; expected some of {sorted(_OIP_PARAMETERS)}")
        glossary = params.get("glossary")
        if glossary is not None:
            try:
                glossary = json.loads(glossary) if isinstance(glossary, str) else None
            except json.JSONDecodeError:
                glossary = None
            if not isinstance(glossary, dict):
                raise OIPError(400, "parameter glossary must be a JSON object of strings, sent as a string")
        n = params.get("n", 1)
        ask = TranslationAsk(texts, params.get("num_beams"), None, n, glossary, False, params.get("source_lang"),
                             params.get("target_lang"))
        docs = self.checked_documents(ask)
        outs = await self.translate(request, docs, n)
        outputs = [{"name": "translation", "datatype": "BYTES", "shape": [len(outs)], "data": [o.text for o in outs]},
                   {"name": "score", "datatype": "FP32", "shape": [len(outs)], "data": [o.score for o in outs]}]
        if n > 1:
            alternatives = [t for o in outs for t in [a for a, _ in o.alternatives] + [""] * (n - len(o.alternatives))]
            outputs.append({"name": "alternatives", "datatype": "BYTES", "shape": [len(outs), n],
                            "data": alternatives})
        return outputs
