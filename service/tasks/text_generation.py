"""Text generation (causal LMs): the continuous-batching engine; attention maps of a text. The HTTP API is
OpenAI's (`service.routes.completions`)."""

from __future__ import annotations

from typing import Any

from model import attention_maps as am
from model.embeddings import embed_token_lists
from service.engine import GenerationEngine
from service.schemas import AttentionRequest
from service.tasks.base import AttentionResult, ServedModel


class ServedLanguageModel(ServedModel):
    embeds = "text"
    task = "text-generation"

    def build_worker(self) -> GenerationEngine:
        s = self.settings
        self.engine = GenerationEngine(self.name, self.loaded, max_slots=s.max_running_requests,
                                       max_queue=s.max_queue, max_model_len=s.max_model_len,
                                       timeout_s=s.request_timeout_s, metrics=self.metrics,
                                       cuda_graphs=s.cuda_graphs, compile=s.compile)
        self.build_embedder(lambda ids: list(embed_token_lists(self.loaded, ids).cpu()))
        return self.engine

    def warm_up(self) -> None:
        self.engine.warm_up()

    def attention_maps(self, body: AttentionRequest, context: Any) -> AttentionResult:
        ids = self.text_ids(body.input)
        self.bound_weights(body, len(ids))
        return AttentionResult(am.lm_attention_ids(self.loaded, ids, body.layers, body.heads))

    def lens_inputs(self, body: Any, own_translation: list[int] | None) -> tuple[list[int], list[int] | None]:
        return self.text_ids(body.input), None
