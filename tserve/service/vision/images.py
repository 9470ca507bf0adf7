"""Image uploads decoded safely (limits checked from the header, before any pixel is decompressed) and the
classifier's batch function."""

from __future__ import annotations

import io
import warnings
from typing import NamedTuple

import torch
from PIL import Image, UnidentifiedImageError

from tserve.model.checkpoint import LoadedModel
from tserve.service.errors import InvalidInput


def open_image(data: bytes, max_bytes: int, max_pixels: int) -> Image.Image:
    """Decode an upload safely: size and pixel-count limits are checked from the header, before the
    pixels are decompressed (decompression bombs never expand)."""
    if not data:
        raise InvalidInput("the image is empty")
    if len(data) > max_bytes:
        raise InvalidInput(f"the image is {len(data)} bytes; the limit is {max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            w, h = image.size
            if w * h > max_pixels:
                raise InvalidInput(f"the image is {w}x{h} pixels; the limit is {max_pixels} pixels")
            image.load()
    except InvalidInput:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInput(f"not a readable image ({type(exc).__name__})") from exc
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidInput(f"the image is corrupt or truncated ({exc})") from exc
    return image


class Prediction(NamedTuple):
    """One class of an image's classification: its index among the model's classes (two classes may share a
    name, as ImageNet's "crane" and "maillot" do), its name and its probability."""

    index: int
    label: str
    score: float


class Classifier:
    def __init__(self, loaded: LoadedModel, max_image_bytes: int, max_image_pixels: int) -> None:
        self.loaded, self.model = loaded, loaded.model
        self.labels, self.preprocessing = loaded.labels, loaded.preprocessing
        self.max_bytes, self.max_pixels = max_image_bytes, max_image_pixels

    def preprocess(self, data: bytes) -> torch.Tensor:
        """Image bytes -> normalised (C, H, W) tensor; raises InvalidInput."""
        image = open_image(data, self.max_bytes, self.max_pixels)
        try:
            return self.preprocessing(image)
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"the image could not be converted ({exc})") from exc

    @torch.inference_mode()
    def run_batch(self, pixels: list[torch.Tensor]) -> list[list[Prediction]]:
        """Each image's classes with their probabilities, most likely first."""
        batch = torch.stack(pixels)
        if self.loaded.device.type == "cuda":  # pinned, so the copy overlaps with the launch
            batch = batch.pin_memory()
        batch = batch.to(self.loaded.device, self.loaded.dtype, non_blocking=True)
        probs = torch.softmax(self.model(batch).float(), dim=-1)
        scores, order = probs.sort(dim=-1, descending=True)
        return [[Prediction(i, self.labels[i], s) for i, s in zip(o, sc, strict=True)]
                for o, sc in zip(order.tolist(), scores.tolist(), strict=True)]
