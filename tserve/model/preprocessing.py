"""Image preprocessing recorded in a classifier's checkpoint: any image Pillow reads -> the tensor
layout the model was trained on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageOps
from torch import Tensor

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# Hugging Face stores PIL's integer resampling codes.
_HF_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}
# What a config that names no `resample` gets: its image processor's default (transformers' classes).
_DEFAULT_RESAMPLE = {"ViTImageProcessor": 2, "ViTFeatureExtractor": 2, "DeiTImageProcessor": 3,
                     "DeiTFeatureExtractor": 3}


@dataclass
class ImagePreprocessing:
    """Resize, rescale to [0, 1], normalise with mean/std.

    `invert`: "never", "always", or "auto" — datasets like MNIST draw light objects on a dark ground;
    with "auto" an image whose border (background) is on the bright side is inverted to match.
    `fit`: "resize" stretches to image_size; "pad" keeps the aspect ratio and pads with the background;
    "content" crops to the object (pixels brighter than `threshold` of the maximum, after inversion and
    autocontrast), scales its longer side to `content_size` and centres it on a black canvas, the way
    MNIST digits were normalised: photos with the object anywhere in the frame then look like the data.
    `autocontrast`: subtract the background level (median of the border) and stretch the brightest pixel
    to white, so that a grey paper background becomes black as in MNIST-style data.
    """

    image_size: int = 224
    n_channels: int = 3
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: str = "bilinear"
    invert: str = "never"
    fit: str = "resize"
    autocontrast: bool = False
    content_size: int | None = None  # for fit="content"; default image_size
    threshold: float = 0.2  # for fit="content": share of the maximum above which a pixel is object
    # for fit="resize": (height, width) to resize to before a centre crop to image_size (DeiT's 256 then 224);
    # None: straight to image_size
    resize_to: tuple[int, int] | None = None
    rescale: float = 1 / 255  # pixel values times this before the mean and std (a checkpoint's rescale_factor)

    def __post_init__(self) -> None:
        if self.n_channels not in (1, 3):
            raise ValueError("n_channels must be 1 (greyscale) or 3 (RGB)")
        if len(self.mean) != self.n_channels or len(self.std) != self.n_channels:
            raise ValueError("mean and std need one value per channel")
        if self.resample not in _RESAMPLE or self.invert not in ("never", "always", "auto"):
            raise ValueError(f"bad resample {self.resample!r} or invert {self.invert!r}")
        if self.fit not in ("resize", "pad", "content"):
            raise ValueError(f"fit must be 'resize', 'pad' or 'content', got {self.fit!r}")
        if self.content_size is not None and not 1 <= self.content_size <= self.image_size:
            raise ValueError(f"content_size must be in [1, image_size], got {self.content_size}")
        self.mean, self.std = tuple(self.mean), tuple(self.std)
        if self.resize_to is not None:
            self.resize_to = (int(self.resize_to[0]), int(self.resize_to[1]))
            if min(self.resize_to) < self.image_size:
                raise ValueError(f"resize_to {self.resize_to} is smaller than the crop {self.image_size}")

    def to_image(self, image: Image.Image) -> Image.Image:
        """The resized image the model sees (before normalisation): useful for overlays."""
        image = ImageOps.exif_transpose(image)
        if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit greyscale (a PNG's): scaled to 8 bits, not clipped
            wide = np.asarray(image, dtype=np.float64)
            image = Image.fromarray(np.clip(np.rint(wide * (255 / 65535)), 0, 255).astype(np.uint8), "L")
        if image.mode in ("RGBA", "LA", "P"):
            # Transparent pixels become the background colour, not black.
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, rgba)
        image = image.convert("L" if self.n_channels == 1 else "RGB")
        if self._should_invert(image):
            image = ImageOps.invert(image)
        if self.autocontrast:
            image = _autocontrast(image)
        size = (self.image_size, self.image_size)
        if self.fit == "content":
            return self._fit_content(image)
        if self.fit == "pad":
            return ImageOps.pad(image, size, method=_RESAMPLE[self.resample], color=0)
        if self.resize_to is None:
            return image.resize(size, _RESAMPLE[self.resample])
        height, width = self.resize_to  # then the centre, as transformers' center_crop takes it
        image = image.resize((width, height), _RESAMPLE[self.resample])
        top, left = (height - self.image_size) // 2, (width - self.image_size) // 2
        return image.crop((left, top, left + self.image_size, top + self.image_size))

    def _fit_content(self, image: Image.Image) -> Image.Image:
        """Crop to the bounding box of the bright object, scale it into `content_size` keeping the aspect
        ratio, and paste it centred on a black `image_size` canvas."""
        grey = image.convert("L")
        if grey.width * grey.height > 4 * self.image_size**2:
            # Photos: find the object on a median-filtered copy, so that sensor noise and specks do not
            # stretch its bounding box.
            grey = grey.filter(ImageFilter.MedianFilter(5))
        pixels = np.asarray(grey, dtype=np.float32)
        peak = float(pixels.max())
        canvas = Image.new(image.mode, (self.image_size, self.image_size), 0)
        if peak <= 0:
            return canvas
        rows = np.flatnonzero((pixels > self.threshold * peak).any(axis=1))
        cols = np.flatnonzero((pixels > self.threshold * peak).any(axis=0))
        box = (int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1)
        crop = image.crop(box)
        target = self.content_size or self.image_size
        scale = target / max(crop.size)
        w, h = max(1, round(crop.size[0] * scale)), max(1, round(crop.size[1] * scale))
        # Shrinking a large photo in one bilinear step aliases thin strokes away; reduce first.
        if min(crop.size[0] // w, crop.size[1] // h) >= 2:
            crop = crop.reduce(min(crop.size[0] // w, crop.size[1] // h))
        crop = crop.resize((w, h), _RESAMPLE[self.resample])
        canvas.paste(crop, ((self.image_size - w) // 2, (self.image_size - h) // 2))
        return canvas

    def _should_invert(self, image: Image.Image) -> bool:
        if self.invert != "auto":
            return self.invert == "always"
        grey = np.asarray(image.convert("L"), dtype=np.float32)
        h, w = grey.shape
        bh, bw = max(1, h // 8), max(1, w // 8)
        border = np.concatenate([grey[:bh].ravel(), grey[-bh:].ravel(), grey[:, :bw].ravel(), grey[:, -bw:].ravel()])
        centre = grey[h // 4 : h - h // 4 or None, w // 4 : w - w // 4 or None]
        # The background is what most of the border shows: invert when it is on the bright side of the
        # image's range. (Comparing means flips objects that touch the border, e.g. wide pullovers.)
        low, high = float(grey.min()), float(grey.max())
        if high - low < 1:
            return low > 127
        return float(np.median(border)) > (low + high) / 2 and float(border.mean()) > float(centre.mean())

    def __call__(self, image: Image.Image) -> Tensor:
        """PIL image -> float tensor (C, H, W)."""
        return self.normalize(np.asarray(self.to_image(image)))

    def normalize(self, pixels: np.ndarray) -> Tensor:
        """uint8 array (H, W) or (H, W, C) -> normalised float tensor (C, H, W)."""
        # numpy, not torch: this runs on request threads, and a parallel torch op there would start an OpenMP
        # thread pool in each; while such a thread lives, every parallel region of the model's worker thread
        # wakes its helpers the slow way (ViT-S/16 at batch 1: 43 ms instead of 33; tests/model/test_threads.py).
        x = (np.asarray(pixels, dtype=np.float64) * self.rescale).astype(np.float32)  # as transformers rescales
        x = x[None] if x.ndim == 2 else x.transpose(2, 0, 1)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        return torch.from_numpy(np.ascontiguousarray((x - mean) / std))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    def to_array(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 array (H, W) in any polarity/framing -> the uint8 image the model sees (H', W')."""
        mode = "L" if pixels.ndim == 2 else "RGB"
        return np.asarray(self.to_image(Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), mode)))

    @classmethod
    def load(cls, path: str | Path) -> ImagePreprocessing:
        return cls(**json.loads(Path(path).read_text()))

    @classmethod
    def from_hf(cls, cfg: dict, image_size: int, n_channels: int,
                processor: str = "ViTImageProcessor") -> ImagePreprocessing:
        """From a Hugging Face `preprocessor_config.json` (ViTImageProcessor; DeiT's, which resizes and then crops
        the centre: `do_center_crop`, `crop_size`), with its `rescale_factor`. `processor`: the image processor
        class of the model's family, whose defaults fill what the config leaves out, unless the config names its
        own (`image_processor_type`)."""
        processor = cfg.get("image_processor_type") or cfg.get("feature_extractor_type") or processor
        size = cfg.get("size", image_size)
        height, width = (size.get("height", size.get("shortest_edge", image_size)),
                         size.get("width", size.get("shortest_edge", image_size))) if isinstance(size, dict) \
            else (size, size)
        resize_to = None
        if cfg.get("do_center_crop") and cfg.get("crop_size") is not None:
            crop = cfg["crop_size"]
            crop = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop, crop)
            if tuple(map(int, crop)) != (image_size, image_size):
                raise ValueError(f"preprocessor crop_size {crop} differs from the model's image_size {image_size}")
            resize_to = (int(height), int(width))
        elif (int(height), int(width)) != (image_size, image_size):
            raise ValueError(f"preprocessor size {size} differs from the model's image_size {image_size}")
        normalize = cfg.get("do_normalize", True)
        mean = cfg.get("image_mean", [0.5] * n_channels) if normalize else [0.0] * n_channels
        std = cfg.get("image_std", [0.5] * n_channels) if normalize else [1.0] * n_channels
        rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else 1.0
        resample = cfg.get("resample", _DEFAULT_RESAMPLE.get(processor, 2))
        return cls(image_size, n_channels, tuple(mean), tuple(std), _HF_RESAMPLE.get(resample, "bilinear"),
                   resize_to=resize_to, rescale=rescale)


def _autocontrast(image: Image.Image) -> Image.Image:
    """Background (median of a border strip) -> 0, brightest pixel -> 255."""
    pixels = np.asarray(image, dtype=np.float32)
    grey = pixels if pixels.ndim == 2 else pixels.mean(axis=2)
    h, w = grey.shape
    bh, bw = max(1, h // 10), max(1, w // 10)
    border = np.concatenate([grey[:bh].ravel(), grey[-bh:].ravel(), grey[:, :bw].ravel(), grey[:, -bw:].ravel()])
    low = float(np.median(border))
    # In photos the brightest pixel is often noise; a high percentile is the object's real white.
    high = float(np.percentile(grey, 99.9)) if grey.size > 4 * 28 * 28 else float(pixels.max())
    if high - low < 1:
        return image
    out = np.clip((pixels - low) * (255.0 / (high - low)), 0, 255).astype(np.uint8)
    return Image.fromarray(out, image.mode)
