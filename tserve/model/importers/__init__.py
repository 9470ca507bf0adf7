"""Checkpoint importers: one module per format. An importer is a pure mapping and does no loading:

    MODEL_TYPES              the Hugging Face `model_type` values it reads (ours: none; "architecture" picks it)
    config(raw, path)        config.json's fields -> our config (model.config); a field we do not implement
                             is a CheckpointError naming it
    weights(cfg, source)     yields (our parameter name, tensor) from the checkpoint's tensors (a WeightSource,
                             read one tensor at a time), fused or split as our modules need
    generation(raw, path)    optional: the checkpoint's decoding defaults (GenerationDefaults)
    extras(raw, path, cfg)   optional: labels, image preprocessing, task

`model.checkpoint.load` assembles the model from these the same way for every format. Adding a family is
one module here, listed in `_MODULES`, and its tests.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from tserve.model.importers import (
    deit,
    gemma,
    gpt2,
    granite,
    llama,
    m2m100,
    marian,
    mistral,
    phi3,
    qwen2,
    qwen3,
    smollm3,
    t5,
    tserve,
    vit,
)
from tserve.model.importers.base import CheckpointError, GenerationDefaults, WeightSource

_MODULES = (gpt2, marian, m2m100, t5, vit, deit, llama, mistral, qwen2, qwen3, smollm3, gemma, phi3, granite)
IMPORTERS: dict[str, ModuleType] = {t: m for m in _MODULES for t in m.MODEL_TYPES}

__all__ = ["IMPORTERS", "CheckpointError", "GenerationDefaults", "WeightSource", "importer_for"]


def importer_for(raw: dict[str, Any], config_file: Path) -> tuple[ModuleType, str]:
    """The importer of a config.json, and the checkpoint's format name ("tserve", "hf-llama", ...)."""
    if "architecture" in raw:
        return tserve, "tserve"
    if "model_type" not in raw:
        raise CheckpointError(f"{config_file}: neither a tserve config (\"architecture\") nor a Hugging Face one "
                              f"(\"model_type\")")
    kind = raw["model_type"]
    if kind not in IMPORTERS:
        raise CheckpointError(f"{config_file}: Hugging Face model_type {kind!r} is not supported "
                              f"(supported: {', '.join(sorted(IMPORTERS))})")
    return IMPORTERS[kind], f"hf-{kind}"
