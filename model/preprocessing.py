"""Image preprocessing recorded in a classifier's checkpoint: any image Pillow reads -> the tensor
layout the model was trained on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# Hugging Face stores PIL's integer resampling codes.
_HF_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}


@dataclass
class ImagePreprocessing:
    """Resize, rescale to [0, 1], normalise with mean/std.

    `invert`: "never", "always", or "auto" — datasets like MNIST draw light objects on a dark ground;
    with "auto" an image whose border is brighter than its centre is inverted to match.
    `fit`: "resize" stretches to image_size; "pad" keeps the aspect ratio and pads with the background.
    """

    image_size: int = 224
    n_channels: int = 3
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: str = "bilinear"
    invert: str = "never"
    fit: str = "resize"

    def __post_init__(self) -> None:
        if self.n_channels not in (1, 3):
            raise ValueError("n_channels must be 1 (greyscale) or 3 (RGB)")
        if len(self.mean) != self.n_channels or len(self.std) != self.n_channels:
            raise ValueError("mean and std need one value per channel")
        if self.resample not in _RESAMPLE or self.invert not in ("never", "always", "auto"):
            raise ValueError(f"bad resample {self.resample!r} or invert {self.invert!r}")
        if self.fit not in ("resize", "pad"):
            raise ValueError(f"fit must be 'resize' or 'pad', got {self.fit!r}")
        self.mean, self.std = tuple(self.mean), tuple(self.std)

    def to_image(self, image: Image.Image) -> Image.Image:
        """The resized image the model sees (before normalisation): useful for overlays."""
        image = ImageOps.exif_transpose(image)
        if image.mode in ("RGBA", "LA", "P"):
            # Transparent pixels become the background colour, not black.
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, rgba)
        image = image.convert("L" if self.n_channels == 1 else "RGB")
        if self._should_invert(image):
            image = ImageOps.invert(image)
        size = (self.image_size, self.image_size)
        if self.fit == "pad":
            return ImageOps.pad(image, size, method=_RESAMPLE[self.resample], color=0)
        return image.resize(size, _RESAMPLE[self.resample])

    def _should_invert(self, image: Image.Image) -> bool:
        if self.invert != "auto":
            return self.invert == "always"
        grey = np.asarray(image.convert("L"), dtype=np.float32)
        h, w = grey.shape
        bh, bw = max(1, h // 8), max(1, w // 8)
        border = np.concatenate([grey[:bh].ravel(), grey[-bh:].ravel(), grey[:, :bw].ravel(), grey[:, -bw:].ravel()])
        centre = grey[h // 4 : h - h // 4 or None, w // 4 : w - w // 4 or None]
        return float(border.mean()) > float(centre.mean())

    def __call__(self, image: Image.Image) -> Tensor:
        """PIL image -> float tensor (C, H, W)."""
        return self.normalize(np.asarray(self.to_image(image)))

    def normalize(self, pixels: np.ndarray) -> Tensor:
        """uint8 array (H, W) or (H, W, C) -> normalised float tensor (C, H, W)."""
        x = torch.from_numpy(np.array(pixels, dtype=np.float32, copy=True)) / 255.0
        x = x[None] if x.ndim == 2 else x.permute(2, 0, 1)
        mean = torch.tensor(self.mean)[:, None, None]
        std = torch.tensor(self.std)[:, None, None]
        return (x - mean) / std

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ImagePreprocessing:
        return cls(**json.loads(Path(path).read_text()))

    @classmethod
    def from_hf(cls, cfg: dict, image_size: int, n_channels: int) -> ImagePreprocessing:
        """From a Hugging Face `preprocessor_config.json` (ViTImageProcessor)."""
        size = cfg.get("size", image_size)
        if isinstance(size, dict):
            size = size.get("height", size.get("shortest_edge", image_size))
        if int(size) != image_size:
            raise ValueError(f"preprocessor size {size} differs from the model's image_size {image_size}")
        normalize = cfg.get("do_normalize", True)
        mean = cfg.get("image_mean", [0.5] * n_channels) if normalize else [0.0] * n_channels
        std = cfg.get("image_std", [0.5] * n_channels) if normalize else [1.0] * n_channels
        return cls(image_size, n_channels, tuple(mean), tuple(std), _HF_RESAMPLE.get(cfg.get("resample", 2), "bilinear"))
