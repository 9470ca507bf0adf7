"""Image classification (ViT): the dynamic batcher over the classifier's batch function; attention maps of
an image (PNG: the [CLS] row over the image); the Open Inference Protocol's BYTES images or FP32 pixels."""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

import torch
from fastapi import Request

from tserve.model import attention_maps as am
from tserve.model.embeddings import embed_pixels
from tserve.service.engine import DynamicBatcher
from tserve.service.errors import InvalidInput, OIPError
from tserve.service.schemas import AttentionRequest
from tserve.service.served import AttentionResult, ServedModel, batched, bytes_elements
from tserve.service.vision.images import Classifier, Prediction, open_image


def decode_base64(value: str) -> bytes:
    """A base64 image, plain or as a data URL (data:image/png;base64,...); InvalidInput when not base64. Line
    breaks and spaces are not part of it: MIME base64 (`base64` and `openssl base64` without -w0) wraps its lines."""
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput("not valid base64", "invalid_base64") from exc


class ServedClassifier(ServedModel):
    task = "image-classification"
    reads_images = True
    embeds = "image"

    def build_worker(self) -> DynamicBatcher:
        s = self.settings
        self.classifier = Classifier(self.loaded, s.max_image_bytes, s.max_image_pixels)
        self.batcher = DynamicBatcher(self.name, self.classifier.run_batch, max_batch_size=s.batch_max_size,
                                      device=self.loaded.device, max_wait_ms=s.batch_max_wait_ms,
                                      max_queue=s.max_queue, timeout_s=s.request_timeout_s, metrics=self.metrics)
        self.build_embedder(lambda pixels: list(embed_pixels(self.loaded, torch.stack(pixels)).cpu()))
        return self.batcher

    def warm_up(self) -> None:
        cfg = self.loaded.config
        self.classifier.run_batch([torch.zeros(cfg.n_channels, cfg.image_size, cfg.image_size)])

    async def classify(self, request: Request, pixels: list[torch.Tensor]) -> list[list[Prediction]]:
        """Each image's (label, probability) pairs, most likely first; a client that leaves cancels them."""
        results = await batched(request, self.batcher, pixels, "classification")
        self.metrics.images.labels(self.name).inc(len(results))
        return results

    # ----------------------------------------------------------------------------------------------
    def attention_maps(self, body: AttentionRequest, context: Any) -> AttentionResult:
        if body.image is None:
            raise ValueError("this model reads images: give 'image' (base64)")
        s = self.settings
        image = open_image(decode_base64(body.image), s.max_image_bytes, s.max_image_pixels)
        self.bound_weights(body)
        # The picture drawn under the maps is the one the model saw (upright, transparency on white, fitted), so that
        # its patch grid is the maps' grid.
        return AttentionResult(am.vit_attention(self.loaded, self.loaded.preprocessing(image), body.layers,
                                                body.heads), image=self.loaded.preprocessing.to_image(image))

    # ----------------------------------------------------------------------------------------------
    def oip_metadata(self) -> dict[str, Any]:
        cfg = self.loaded.config
        return {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1]},
                           {"name": "pixels", "datatype": "FP32",
                            "shape": [-1, cfg.n_channels, cfg.image_size, cfg.image_size]}],
                "outputs": [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                            {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(self.loaded.labels)]}]}

    async def oip_infer(self, tensor: dict[str, Any], request: Request) -> list[dict[str, Any]]:
        cfg, limits = self.loaded.config, self.settings
        if tensor["name"] == "image":
            pixels = []
            for i, item in enumerate(bytes_elements(tensor, limits.max_prompts)):
                try:
                    blob = decode_base64(item)  # plain or a data URL, as the /v1 routes read it
                    pixels.append(await asyncio.to_thread(self.classifier.preprocess, blob))
                except (ValueError, InvalidInput) as exc:
                    raise OIPError(400, f"image {i}: {exc}") from exc
        else:
            want = [cfg.n_channels, cfg.image_size, cfg.image_size]
            if tensor.get("datatype") != "FP32" or len(tensor["shape"]) != 4 or tensor["shape"][1:] != want:
                raise OIPError(400, f"'pixels' must be FP32 with shape [N, {', '.join(map(str, want))}]")
            if not 1 <= tensor["shape"][0] <= limits.max_prompts:
                raise OIPError(400, f"give 1 to {limits.max_prompts} images")
            try:
                batch = torch.tensor(tensor["data"], dtype=torch.float32).reshape(tensor["shape"])
            except (TypeError, ValueError) as exc:
                raise OIPError(400, "'pixels' data must be numbers") from exc
            if not torch.isfinite(batch).all():
                raise OIPError(400, "'pixels' must be finite")
            pixels = list(batch)
        results = await self.classify(request, pixels)
        classes = len(self.loaded.labels)
        probs = [[0.0] * classes for _ in results]
        for row, ranked in zip(probs, results, strict=True):
            for prediction in ranked:  # by index: two classes may share a name
                row[prediction.index] = prediction.score
        n = len(results)
        return [{"name": "label", "datatype": "BYTES", "shape": [n], "data": [r[0].label for r in results]},
                {"name": "probabilities", "datatype": "FP32", "shape": [n, classes],
                 "data": [p for row in probs for p in row]}]
