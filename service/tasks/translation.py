"""Translation (encoder-decoder): the continuous-batching engine with beams; attention maps of a source and
a target (by default the model's own translation, exactly what `/v1/translations` answers); the Open
Inference Protocol's BYTES text in and out."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from model import attention_maps as am
from model.decoding.constrained_beam import ConstraintsUnmet
from model.embeddings import embed_token_lists
from model.segmentation import Document
from service.connection import while_connected
from service.engine import QueueFull, TranslationEngine, TranslationRequest
from service.engine.output import Hypothesis
from service.errors import OIPError, bad_request, engine_failure
from service.runners import DocumentJob, InvalidInput
from service.schemas import AttentionRequest
from service.tasks.base import AttentionResult, ServedModel, bytes_elements


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


async def collect_translation(engine: TranslationEngine, req: TranslationRequest) -> SegmentResult:
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


def assemble(doc: DocumentJob, segments: list[SegmentResult], n: int) -> TranslationOutput:
    """The document's translation and up to `n` distinct alternatives: alternative k joins each segment's
    k-th best distinct hypothesis (its last one where it has fewer)."""
    options = []
    for seg in segments:
        distinct: dict[str, Hypothesis] = {}
        for h in seg.hypotheses:
            distinct.setdefault(h.text, h)
        options.append(list(distinct.values()))
    alternatives: dict[str, float] = {}
    for k in range(max(len(o) for o in options) if n > 1 else 1):
        picks = [o[min(k, len(o) - 1)] for o in options]
        text = doc.document.join([h.text for h in picks])
        alternatives.setdefault(text, weighted_score([(h.score, len(h.token_ids)) for h in picks]))
    best_text = doc.document.join([seg.text for seg in segments])
    score = weighted_score([(seg.hypotheses[0].score, len(seg.token_ids)) for seg in segments])
    alts = [(best_text, score)] + [(t, sc) for t, sc in alternatives.items() if t != best_text]
    return TranslationOutput(best_text, [t for seg in segments for t in seg.token_ids], score,
                             "length" if any(seg.finish_reason == "length" for seg in segments) else "stop",
                             alts[:n])


MAX_GLOSSARY_TERM_CHARS = 100


class ServedTranslator(ServedModel):
    embeds = "text"
    task = "translation"
    scores_targets = True
    generated_attention_modules = 2  # decoder.self and decoder.cross

    def build_worker(self) -> TranslationEngine:
        s = self.settings
        self.engine = TranslationEngine(self.name, self.loaded, max_rows=s.max_running_requests,
                                        max_queue=s.max_queue, timeout_s=s.request_timeout_s, metrics=self.metrics,
                                        cuda_graphs=s.cuda_graphs)
        self.build_embedder(lambda ids: list(embed_token_lists(self.loaded, ids).cpu()))
        return self.engine

    def warm_up(self) -> None:
        self.engine.warm_up()

    def documents(self, texts: list[str], num_beams: int | None = None, max_tokens: int | None = None,
                  n: int = 1, glossary: dict[str, str] | None = None) -> list[DocumentJob]:
        """A document job (segments) per text, each checked against the server's and the model's limits
        (InvalidInput; ConstraintsUnmet when glossary terms cannot fit in max_tokens)."""
        docs, limit = [], self.settings.max_input_chars
        self.check_glossary(glossary)
        beams = num_beams or self.loaded.generation.num_beams
        if n > beams:
            raise InvalidInput(f"n {n} exceeds num_beams {beams}: each alternative is a beam's hypothesis",
                               "invalid_n")
        for i, text in enumerate(texts):
            if not text.strip():
                raise InvalidInput(f"input {i} is empty", "empty_input")
            if len(text) > limit:
                raise InvalidInput(f"input {i} has {len(text)} characters; the limit is {limit}", "input_too_long")
            try:
                docs.append(self.engine.translator.document(text, num_beams, max_tokens, glossary))
            except InvalidInput as exc:
                raise InvalidInput(f"input {i}: {exc}", exc.code or "input_too_long") from exc
        return docs

    def check_glossary(self, glossary: dict[str, str] | None) -> None:
        if not glossary:
            return
        limit = self.settings.max_glossary_entries
        if len(glossary) > limit:
            raise InvalidInput(f"the glossary has {len(glossary)} entries; the limit is {limit} "
                               "(--max-glossary-entries)", "invalid_glossary")
        for source, target in glossary.items():
            for term in (source, target):
                if not term.strip() or len(term) > MAX_GLOSSARY_TERM_CHARS:
                    raise InvalidInput(f"glossary terms must be 1 to {MAX_GLOSSARY_TERM_CHARS} characters and not "
                                       f"blank: {source!r} -> {target!r}", "invalid_glossary")

    def submit(self, docs: list[DocumentJob]) -> list[list[TranslationRequest]]:
        """Queue every segment of every document as parts of one client request (raises the HTTP error)."""
        try:
            reqs = self.engine.submit_all([job for d in docs for job in d.jobs], one_request=True)
        except (QueueFull, ValueError) as exc:
            raise engine_failure(exc, "translation") from exc
        out, start = [], 0
        for d in docs:
            out.append(reqs[start: start + len(d.jobs)])
            start += len(d.jobs)
        return out

    async def translate(self, request: Request, docs: list[DocumentJob], n: int = 1) -> list[TranslationOutput]:
        """Each document's translation, as `/v1/translations` answers it; a client that leaves cancels it."""
        engine, parts = self.engine, self.submit(docs)
        reqs = [r for p in parts for r in p]
        try:
            results = await while_connected(request, asyncio.gather(*(collect_translation(engine, r) for r in reqs)))
        except Exception as exc:
            raise engine_failure(exc, "translation") from exc
        finally:
            for r in reqs:
                r.cancel()
        out, start = [], 0
        for d, p in zip(docs, parts, strict=True):
            out.append(assemble(d, results[start: start + len(p)], n))
            start += len(p)
        return out

    # ----------------------------------------------------------------------------------------------
    async def attention_context(self, request: Request, body: AttentionRequest) -> list[int] | None:
        """Without a target: the model's own translation of the input, from the engine like any other."""
        if body.target is not None or not body.input or not body.input.strip():
            return None
        try:
            self.text_ids(body.input)
            job = self.engine.translator.job(body.input, None, None)
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_attention_request") from exc
        doc = DocumentJob(Document([body.input], ["", ""]), [job])
        return (await self.translate(request, [doc]))[0].token_ids

    def attention_maps(self, body: AttentionRequest, own_translation: list[int] | None) -> AttentionResult:
        tok, eos = self.loaded.tokenizer, self.loaded.config.eos_token_id
        src = self.text_ids(body.input)
        target_ids = own_translation if own_translation is not None else tok.encode_target(body.target or "")
        target_ids = [t for t in target_ids if t != eos]
        self.bound_weights(body, len(src), len(target_ids))
        maps = am.translation_attention_ids(self.loaded, src, target_ids, body.layers, body.heads)
        target = body.target if own_translation is None else tok.decode(target_ids)
        return AttentionResult(maps, extra={"target": target})

    def lens_inputs(self, body: Any, own_translation: list[int] | None) -> tuple[list[int], list[int] | None]:
        """The decoder's inputs: the start token, then the target (by default the model's own translation)."""
        tok, cfg = self.loaded.tokenizer, self.loaded.config
        src = self.text_ids(body.input)
        target = own_translation if own_translation is not None else tok.encode_target(body.target or "")
        target = [t for t in target if t != cfg.eos_token_id]
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
        """Parameters: `n` (integer), `num_beams` (integer), `glossary` (a JSON object in a string). Outputs:
        `translation` [len], `score` [len] and, with n > 1, `alternatives` [len, n] (best first; "" where an
        input has fewer distinct ones)."""
        texts = bytes_elements(tensor, self.settings.max_prompts)
        params = tensor.get("parameters") or {}
        n, beams, glossary = params.get("n", 1), params.get("num_beams"), params.get("glossary")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
            raise OIPError(400, "parameter n must be an integer from 1 to 16")
        if beams is not None and (not isinstance(beams, int) or isinstance(beams, bool) or not 1 <= beams <= 16):
            raise OIPError(400, "parameter num_beams must be an integer from 1 to 16")
        if glossary is not None:
            try:
                glossary = json.loads(glossary) if isinstance(glossary, str) else None
            except json.JSONDecodeError:
                glossary = None
            if not isinstance(glossary, dict) or not all(isinstance(v, str) for v in glossary.values()):
                raise OIPError(400, "parameter glossary must be a JSON object of strings, sent as a string")
        try:
            docs = self.documents(texts, beams, None, n, glossary)
        except InvalidInput as exc:
            raise OIPError(400, str(exc)) from exc
        except ConstraintsUnmet as exc:
            raise OIPError(422, str(exc)) from exc
        outs = await self.translate(request, docs, n)
        outputs = [{"name": "translation", "datatype": "BYTES", "shape": [len(outs)], "data": [o.text for o in outs]},
                   {"name": "score", "datatype": "FP32", "shape": [len(outs)], "data": [o.score for o in outs]}]
        if n > 1:
            alternatives = [t for o in outs for t in [a for a, _ in o.alternatives] + [""] * (n - len(o.alternatives))]
            outputs.append({"name": "alternatives", "datatype": "BYTES", "shape": [len(outs), n],
                            "data": alternatives})
        return outputs
