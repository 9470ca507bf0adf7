"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the Llama layout (model.importers.llama) with biases on the q, k and
v projections (never on o). With `use_sliding_window`, the layers from `max_window_layers` on (or as
`layer_types` says) attend within `sliding_window`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tserve.model.config import DecoderConfig
from tserve.model.importers.llama import decoder_config, generation, qwen_sliding, weights

MODEL_TYPES = ("qwen2",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    return decoder_config(raw, path, qkv_bias=True, out_bias=False, sliding=qwen_sliding(raw))
