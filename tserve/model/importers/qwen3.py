"""Qwen3 (`Qwen3ForCausalLM`): the Llama layout (model.importers.llama) with an RMSNorm over each head's
queries and keys before the rotation, `head_dim` of its own (128 unless the config says) and biases as
`attention_bias` says. Sliding windows as Qwen2's (model.importers.llama.qwen_sliding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tserve.model.config import DecoderConfig
from tserve.model.importers.llama import decoder_config, generation, qwen_sliding, weights

MODEL_TYPES = ("qwen3",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    raw = {"head_dim": 128} | raw  # Qwen3Config's default, which save_pretrained always writes anyway
    bias = bool(raw.get("attention_bias", False))
    return decoder_config(raw, path, qkv_bias=bias, out_bias=bias, qk_norm=True, sliding=qwen_sliding(raw))
