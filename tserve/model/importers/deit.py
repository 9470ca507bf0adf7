"""DeiT (`DeiTForImageClassification`, `DeiTForImageClassificationWithTeacher`): ViT's layout and maths
(model.importers.vit) with a distillation token after the class token; trained with a teacher, a second head on
that token, the two heads' logits averaged as transformers does at inference."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from tserve.model.config import ViTConfig
from tserve.model.importers import vit
from tserve.model.importers.base import WeightSource

MODEL_TYPES = ("deit",)
extras = vit.extras
WITH_TEACHER = "DeiTForImageClassificationWithTeacher"


def config(raw: dict[str, Any], path: Path) -> ViTConfig:
    teacher = WITH_TEACHER in (raw.get("architectures") or [])
    return replace(vit.config(raw, path), distillation_token=True, distillation_head=teacher)


def weights(cfg: ViTConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    hf.strip_prefix("deit.")
    heads = {"head": "cls_classifier", "head_dist": "distillation_classifier"} if cfg.distillation_head else \
        {"head": "classifier"}
    yield "dist_token", hf["embeddings.distillation_token"]
    yield from vit.weights(cfg, hf, heads)
