"""What serving one model of a task means, as one class per task: the worker that holds its requests,
warm-up, attention maps, and (where the task speaks it) the Open Inference Protocol. The registry builds a
task's `ServedModel` from a loaded checkpoint; routes call these methods and never ask which task a model
does. A new task is a module with a `ServedModel` subclass passed to `register` (see `service.tasks`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from fastapi import Request

from tserve.model import attention_maps as am
from tserve.model import logit_lens as lens
from tserve.model.checkpoint import LoadedModel
from tserve.model.embeddings import max_input_tokens
from tserve.service.connection import run_job, while_connected
from tserve.service.engine import DynamicBatcher, Worker
from tserve.service.errors import InvalidInput, OIPError, engine_failure
from tserve.service.metrics import Metrics
from tserve.service.schemas import AttentionRequest
from tserve.service.settings import Settings

T = TypeVar("T")


@dataclass
class AttentionResult:
    maps: list[am.AttentionMap]
    image: Any = None  # the decoded image, for a PNG overlay
    extra: dict[str, Any] = field(default_factory=dict)  # task-specific fields of the JSON answer


class ServedModel:
    task: ClassVar[str]  # the checkpoint task this class serves (LoadedModel.task)
    embeds: ClassVar[str | None] = None  # what /v1/embeddings takes for it: "text", "image" or nothing
    reads_images: ClassVar[bool] = False  # /v1/attention without 'model' picks it for an 'image'
    scores_targets: ClassVar[bool] = False  # ... and for a 'target'
    generated_attention_modules: ClassVar[int] = 1  # maps per layer of `return_attention` (decoder.self, ...)
    has_logit_lens: ClassVar[bool] = False  # /v1/logit_lens without 'model' picks it (`lens_inputs`)
    drafts: ClassVar[bool] = False  # decodes with --draft-model's drafts, a model of its own task

    def __init__(self, name: str, loaded: LoadedModel, settings: Settings, metrics: Metrics) -> None:
        self.name, self.loaded, self.settings, self.metrics = name, loaded, settings, metrics
        self.created = int(time.time())
        self.worker: Worker = self.build_worker()

    def build_worker(self) -> Worker:
        raise NotImplementedError

    async def call(self, request: Request | None, what: str, invalid_code: str, fn: Callable[..., T],
                   *args: Any) -> T:
        """`fn(*args)` as a call job of this model's worker (`connection.run_job`): queued with its requests, run in
        its thread, cancelled when the client leaves; errors mapped as the engine's (`what`, `invalid_code`)."""
        return await run_job(request, self.worker, what, invalid_code, fn, *args)

    @property
    def workers(self) -> list[Worker]:
        """Every worker thread of this model (started, drained and stopped by the registry)."""
        return [self.worker] + ([self.embedder] if self.embedder is not None else [])

    # ----------------------------------------------------------------------------------------------
    # /v1/embeddings
    # ----------------------------------------------------------------------------------------------
    embedder: DynamicBatcher | None = None

    def build_embedder(self, batch_fn: Callable[[list[Any]], list[Any]]) -> None:
        """A dynamic batcher for embeddings, beside the model's main worker (same limits as classifications)."""
        s = self.settings
        self.embedder = DynamicBatcher(f"{self.name}/embeddings", batch_fn, max_batch_size=s.batch_max_size,
                                       device=self.loaded.device, max_wait_ms=s.batch_max_wait_ms,
                                       max_queue=s.max_queue, timeout_s=s.request_timeout_s, metrics=self.metrics)

    async def embed(self, request: Request, items: list[Any]) -> list[list[float]]:
        """One L2-normalised vector per item (token ids or preprocessed pixels), batched with other requests';
        a client that leaves cancels them."""
        results = await batched(request, self.embedder, items, "embedding")
        self.metrics.embeddings.labels(self.name).inc(len(results))
        return results

    def card_fields(self) -> dict[str, Any]:
        """What `/v1/models` says of this model beyond its name, creation time and task (`ModelCard`'s fields)."""
        return {}

    def warm_up(self) -> None:
        """One small request through the worker's own model code (before the worker starts), so that the
        first real one does not pay for lazy initialisation."""

    # ----------------------------------------------------------------------------------------------
    # /v1/attention
    # ----------------------------------------------------------------------------------------------
    async def attention_context(self, request: Request, body: AttentionRequest) -> Any:
        """What the maps need that other requests of this model compute first (on the event loop)."""
        return None

    def attention_maps(self, body: AttentionRequest, context: Any) -> AttentionResult:
        """The maps, run as a call job in the worker's thread; a ValueError is the client's (400). The
        weight bound (`bound_weights`) is checked before the model runs."""
        raise InvalidInput(f"model {self.name!r} ({self.task}) has no attention maps", "invalid_attention_request")

    def lens_inputs(self, body: Any, own_translation: list[int] | None) -> tuple[list[int], list[int] | None]:
        """The token ids the logit lens reads (the decoder's inputs) and, for a translator, the source ids."""
        raise InvalidInput(f"model {self.name!r} ({self.task}) has no logit lens", "invalid_lens_request")

    def logit_lens(self, body: Any, own_translation: list[int] | None) -> dict[str, Any]:
        """`/v1/logit_lens`'s answer less the model name, run as a call job in the worker's thread; the entries
        bound (--max-lens-entries) is checked before the model runs."""
        ids, source = self.lens_inputs(body, own_translation)
        layers = am.layer_selection(body.layers, lens.n_layers(self.loaded))
        entries, limit = len(layers) * len(ids) * body.top_k, self.settings.max_lens_entries
        if entries > limit:
            raise InvalidInput(f"{entries} entries asked for (layers x positions x top_k); the limit is {limit}: "
                               "ask for fewer 'layers', a smaller 'top_k' or a shorter input", "too_many_entries")
        names = self.loaded.tokenizer.tokens(ids)
        out = lens.logit_lens(self.loaded, ids, layers, body.top_k, source)
        return {"tokens": names, "layers": [
            {"layer": r.layer, "positions": [
                {"token": names[j], "top": [{"token": t, "prob": p}
                                            for t, p in zip(self.loaded.tokenizer.tokens(top), probs, strict=True)]}
                for j, (top, probs) in enumerate(zip(r.top_ids, r.top_probs, strict=True))]}
            for r in out]}

    def bound_weights(self, body: AttentionRequest, n_tokens: int = 0, n_target: int = 0) -> None:
        """--max-attention-floats, from the token counts, before any model work."""
        limit = self.settings.max_attention_floats
        floats = am.weight_count(self.loaded, body.layers, body.heads, n_tokens, n_target)
        if floats > limit:
            raise InvalidInput(f"this selection has {floats} attention weights; the limit is {limit}: ask for "
                               "fewer 'layers' or 'heads', or a shorter input", "too_many_weights")

    def embedding_ids(self, text: str, source_lang: str | None = None) -> list[int]:
        """What `/v1/embeddings` reads of a text (a multilingual translator: in `source_lang`)."""
        if source_lang is not None:
            raise InvalidInput(f"model {self.name!r} takes no source_lang")
        return self.text_ids(text)

    def text_ids(self, text: str | None) -> list[int]:
        """A text input's token ids within the model's length; ValueError otherwise."""
        if not text or not text.strip():
            raise ValueError("give the text to look at in 'input'")
        ids = self.loaded.tokenizer.encode(text)
        if not ids:
            raise ValueError("the input is empty after tokenization")
        limit = max_input_tokens(self.loaded)
        if len(ids) > limit:
            raise ValueError(f"the input has {len(ids)} tokens; this model takes at most {limit}")
        return ids

    # ----------------------------------------------------------------------------------------------
    # Open Inference Protocol (/v2)
    # ----------------------------------------------------------------------------------------------
    def oip_metadata(self) -> dict[str, Any] | None:
        """`{"inputs": [...], "outputs": [...]}` tensor descriptions, or None: not served over /v2."""
        return None

    async def oip_infer(self, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
        """The output tensors for one validated input tensor (its name is one of the metadata's inputs)."""
        raise OIPError(404, f"model {self.name!r} is not served over this protocol")


async def batched(request: Request, batcher: DynamicBatcher, items: list[Any], what: str) -> list[Any]:
    """Each item's result from `batcher`, all queued or none; a client that leaves cancels them."""
    try:
        reqs = batcher.enqueue(items)
        return await while_connected(request, asyncio.gather(*(batcher.result(r) for r in reqs)))
    except Exception as exc:
        raise engine_failure(exc, what) from exc


def bytes_elements(tensor: dict[str, Any], limit: int) -> list[str]:
    """The strings of an OIP BYTES tensor of shape [N], 1 <= N <= limit."""
    if tensor.get("datatype") != "BYTES" or len(tensor["shape"]) != 1:
        raise OIPError(400, f"input {tensor['name']!r} must be BYTES with shape [N]")
    if not tensor["data"] or len(tensor["data"]) > limit:
        raise OIPError(400, f"give 1 to {limit} elements")
    if not all(isinstance(x, str) for x in tensor["data"]):
        raise OIPError(400, "BYTES elements must be strings")
    return tensor["data"]
