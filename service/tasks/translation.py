"""Translation (encoder-decoder): the continuous-batching engine with beams; attention maps of a source and
a target (by default the model's own translation, exactly what `/v1/translations` answers); the Open
Inference Protocol's BYTES text in and out."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from model import attention_maps as am
from service.connection import while_connected
from service.engine import QueueFull, TranslationEngine, TranslationRequest
from service.errors import OIPError, bad_request, engine_failure
from service.runners import InvalidInput, TranslationJob
from service.schemas import AttentionRequest
from service.tasks.base import AttentionResult, ServedModel, bytes_elements


async def collect_translation(engine: TranslationEngine, req: TranslationRequest) -> tuple[str, list[int]]:
    """The text and ids of one translation request, once it has finished."""
    text, ids = "", []
    async for event in engine.stream(req):
        text += event.text
        ids += event.token_ids
    return text, ids


class ServedTranslator(ServedModel):
    task = "translation"
    scores_targets = True
    generated_attention_modules = 2  # decoder.self and decoder.cross

    def build_worker(self) -> TranslationEngine:
        s = self.settings
        self.engine = TranslationEngine(self.name, self.loaded, max_rows=s.max_running_requests,
                                        max_queue=s.max_queue, timeout_s=s.request_timeout_s, metrics=self.metrics,
                                        cuda_graphs=s.cuda_graphs)
        return self.engine

    def warm_up(self) -> None:
        self.engine.warm_up()

    def jobs(self, texts: list[str], num_beams: int | None = None,
             max_tokens: int | None = None) -> list[TranslationJob]:
        """Engine jobs for texts, each checked against the server's and the model's limits (InvalidInput)."""
        jobs, limit = [], self.settings.max_input_chars
        for i, text in enumerate(texts):
            if not text.strip():
                raise InvalidInput(f"input {i} is empty", "empty_input")
            if len(text) > limit:
                raise InvalidInput(f"input {i} has {len(text)} characters; the limit is {limit}", "input_too_long")
            try:
                jobs.append(self.engine.translator.job(text, num_beams, max_tokens))
            except InvalidInput as exc:
                raise InvalidInput(f"input {i}: {exc}", "input_too_long") from exc
        return jobs

    async def translate(self, request: Request, jobs: list[TranslationJob]) -> list[tuple[str, list[int]]]:
        """(text, ids) of each job, as `/v1/translations` answers it; a client that leaves cancels them."""
        engine = self.engine
        try:
            reqs = engine.submit_all(jobs)
        except (QueueFull, ValueError) as exc:
            raise engine_failure(exc, "translation") from exc
        try:
            return await while_connected(request, asyncio.gather(*(collect_translation(engine, r) for r in reqs)))
        except Exception as exc:
            raise engine_failure(exc, "translation") from exc
        finally:
            for r in reqs:
                r.cancel()

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
        return (await self.translate(request, [job]))[0][1]

    def attention_maps(self, body: AttentionRequest, own_translation: list[int] | None) -> AttentionResult:
        tok, eos = self.loaded.tokenizer, self.loaded.config.eos_token_id
        src = self.text_ids(body.input)
        target_ids = own_translation if own_translation is not None else tok.encode_target(body.target or "")
        target_ids = [t for t in target_ids if t != eos]
        self.bound_weights(body, len(src), len(target_ids))
        maps = am.translation_attention_ids(self.loaded, src, target_ids, body.layers, body.heads)
        target = body.target if own_translation is None else tok.decode(target_ids)
        return AttentionResult(maps, extra={"target": target})

    # ----------------------------------------------------------------------------------------------
    def oip_metadata(self) -> dict[str, Any]:
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
                "outputs": [{"name": "translation", "datatype": "BYTES", "shape": [-1]}]}

    async def oip_infer(self, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
        texts = bytes_elements(tensor, self.settings.max_prompts)
        try:
            jobs = self.jobs(texts)
        except InvalidInput as exc:
            raise OIPError(400, str(exc)) from exc
        out = [text for text, _ in await self.translate(request, jobs)]
        return [{"name": "translation", "datatype": "BYTES", "shape": [len(out)], "data": out}]
