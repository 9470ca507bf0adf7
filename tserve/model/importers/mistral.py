"""Mistral (`MistralForCausalLM`): the Llama layout (model.importers.llama) whose layers all attend within
`sliding_window` when the config sets one (Mistral 7B v0.1: 4096 of a 32k context)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tserve.model.config import DecoderConfig
from tserve.model.importers.llama import decoder_config, generation, sliding_layers, weights

MODEL_TYPES = ("mistral",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    sliding = sliding_layers(raw, raw["num_hidden_layers"], default_all=True)
    return decoder_config(raw, path, qkv_bias=False, out_bias=False, sliding=sliding)
