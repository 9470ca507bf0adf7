"""Granite 3.x (`GraniteForCausalLM`): the Llama layout (model.importers.llama) with four multipliers:
embeddings times `embedding_multiplier`, scores scaled by `attention_multiplier` (instead of 1 / sqrt(head
size)), each sub-layer's output times `residual_multiplier` before the residual add, and logits divided by
`logits_scaling`. Its weights are the Llama layout's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tserve.model.config import DecoderConfig
from tserve.model.importers import llama

MODEL_TYPES = ("granite",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]
generation, weights = llama.generation, llama.weights


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    raw = {"tie_word_embeddings": True} | raw  # GraniteConfig's default
    bias = bool(raw.get("attention_bias", False))
    cfg = llama.decoder_config(raw, path, qkv_bias=bias, out_bias=bias)
    scale = raw.get("attention_multiplier")
    return replace(cfg, embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                   attention_scale=float(scale) if scale is not None else None,
                   logits_divisor=float(raw.get("logits_scaling", 1.0)),
                   residual_multiplier=float(raw.get("residual_multiplier", 1.0)))

