"""Our own format: config.json with "architecture" (model.config), weights under our module names,
generation.json, and labels.json / preprocessing.json for classifiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

from tserve.model.config import BlockConfig, ViTConfig
from tserve.model.importers.base import CheckpointError, GenerationDefaults, WeightSource, read_json
from tserve.model.preprocessing import ImagePreprocessing

MODEL_TYPES: tuple[str, ...] = ()  # chosen by config.json's "architecture", not by a model_type
_NOT_CONFIG = ("source_lang", "target_lang", "task")  # beside the model config in config.json


def config(raw: dict[str, Any], path: Path) -> BlockConfig:
    task = raw.get("task")  # what the checkpoint is served for; default: its architecture's task
    if task is not None and not isinstance(task, str):
        raise CheckpointError(f"{path / 'config.json'}: 'task' must be a string")
    try:
        return BlockConfig.from_dict({k: v for k, v in raw.items() if k not in _NOT_CONFIG})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from exc


def generation(raw: dict[str, Any], path: Path) -> GenerationDefaults:
    return GenerationDefaults.from_dict(read_json(path / "generation.json", required=False) or {})


def extras(raw: dict[str, Any], path: Path, cfg: BlockConfig) -> dict[str, Any]:
    found: dict[str, Any] = {"task": raw["task"]} if raw.get("task") else {}
    if isinstance(cfg, ViTConfig):
        labels = read_json(path / "labels.json", required=False) or [str(i) for i in range(cfg.n_classes)]
        if len(labels) != cfg.n_classes:
            raise CheckpointError(f"{path / 'labels.json'}: {len(labels)} labels for {cfg.n_classes} classes")
        pre = path / "preprocessing.json"
        found["labels"] = labels
        found["preprocessing"] = (
            ImagePreprocessing.load(pre) if pre.is_file()
            else ImagePreprocessing(cfg.image_size, cfg.n_channels, (0.5,) * cfg.n_channels, (0.5,) * cfg.n_channels)
        )
    return found


def weights(cfg: BlockConfig, source: WeightSource) -> Iterator[tuple[str, Tensor]]:
    for name in source.names():
        yield name, source[name]
