"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama layout (model.importers.llama) in which some layers' attention
takes no positions (NoPE): `no_rope_layers` holds 1 for a layer that rotates and 0 for one that does not (every
fourth, by default). With `use_sliding_window`, the layers `layer_types` marks attend within `sliding_window`
(without it, as SmolLM3Config defaults it: the layers without positions)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tserve.model.config import DecoderConfig
from tserve.model.importers.common import unsupported
from tserve.model.importers.llama import decoder_config, generation, sliding_layers, weights

MODEL_TYPES = ("smollm3",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    bias = bool(raw.get("attention_bias", False))
    cfg = decoder_config(raw, path, qkv_bias=bias, out_bias=bias)
    flags = raw.get("no_rope_layers")
    if flags is None:  # SmolLM3Config's default: every `no_rope_layer_interval`-th layer without positions
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(cfg.n_layers)]
    if not isinstance(flags, list) or len(flags) != cfg.n_layers or any(f not in (0, 1) for f in flags):
        raise unsupported(path, "no_rope_layers", flags, f"one 0 or 1 per layer ({cfg.n_layers})")
    nope = [i for i, rotates in enumerate(flags) if not rotates]
    sliding = []
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        sliding = sliding_layers(raw, cfg.n_layers, default_all=False) if raw.get("layer_types") else nope
    return replace(cfg, nope_layers=nope, sliding_window=raw.get("sliding_window") if sliding else None,
                   sliding_layers=sliding)
