"""Mistral (`MistralForCausalLM`): the Llama layout (model.importers.llama) with a sliding attention window.
A sequence that fits in the window attends exactly as with full attention, so the served context is capped
at `sliding_window`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tserve.model.config import DecoderConfig
from tserve.model.importers.llama import decoder_config, generation, weights

MODEL_TYPES = ("mistral",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    return decoder_config(raw, path, qkv_bias=False, out_bias=False, sliding_window=raw.get("sliding_window"))
