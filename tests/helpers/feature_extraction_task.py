"""A fourth task, test-only, to show that a task is one module: text embeddings ("feature-extraction") from a
decoder checkpoint whose config.json says `"task": "feature-extraction"`. An input's embedding is the final
hidden state of its last token (causal attention: it has read the whole input). Served by the dynamic
batcher; attention maps of the text; the Open Inference Protocol's BYTES text in, FP32 embeddings out.
`tserve serve --task-modules tests.helpers.feature_extraction_task` (from the repository root) registers
it."""

from __future__ import annotations

from typing import Any

import torch
from fastapi import Request

from tserve.model import attention_maps as am
from tserve.service.connection import while_connected
from tserve.service.engine import DynamicBatcher
from tserve.service.errors import OIPError, engine_failure
from tserve.service.schemas import AttentionRequest
from tserve.service.served import bytes_elements
from tserve.service.tasks import AttentionResult, ServedModel, register


@torch.inference_mode()
def embed(loaded, texts: list[str]) -> list[list[float]]:  # noqa: ANN001
    """Each text's embedding (d_model floats), one forward pass per text."""
    out = []
    for text in texts:
        ids = torch.tensor([loaded.tokenizer.encode(text)], device=loaded.device)
        positions = torch.arange(ids.size(1), device=ids.device)[None]
        hidden, _ = loaded.model._run(ids, positions, mask=None, is_causal=True)
        out.append(hidden[0, -1].float().tolist())
    return out


@register
class ServedEmbedder(ServedModel):
    task = "feature-extraction"

    def build_worker(self) -> DynamicBatcher:
        s = self.settings
        self.batcher = DynamicBatcher(self.name, lambda texts: embed(self.loaded, texts),
                                      max_batch_size=s.batch_max_size, max_wait_ms=s.batch_max_wait_ms,
                                      max_queue=s.max_queue, timeout_s=s.request_timeout_s, metrics=self.metrics,
                                      device=self.loaded.device)
        return self.batcher

    def warm_up(self) -> None:
        embed(self.loaded, ["Hello"])

    def attention_maps(self, body: AttentionRequest, context: Any) -> AttentionResult:
        ids = self.text_ids(body.input)
        self.bound_weights(body, len(ids))
        return AttentionResult(am.lm_attention_ids(self.loaded, ids, body.layers, body.heads))

    def oip_metadata(self) -> dict[str, Any]:
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
                "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, self.loaded.config.d_model]}]}

    async def oip_infer(self, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
        texts = bytes_elements(tensor, self.settings.max_prompts)
        if not all(t.strip() for t in texts):
            raise OIPError(400, "every text must be non-empty")
        try:
            items = self.batcher.enqueue(texts)
            vectors = await while_connected(request, _gather(self.batcher, items))
        except Exception as exc:
            raise engine_failure(exc, "feature extraction") from exc
        return [{"name": "embedding", "datatype": "FP32", "shape": [len(vectors), self.loaded.config.d_model],
                 "data": [x for v in vectors for x in v]}]


async def _gather(batcher: DynamicBatcher, items: list) -> list:
    return [await batcher.result(item) for item in items]
