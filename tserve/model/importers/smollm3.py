"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama layout (model.importers.llama) in which some layers' attention
takes no positions (NoPE): `no_rope_layers` holds 1 for a layer that rotates and 0 for one that does not (every
fourth, by default). A sliding window, when `use_sliding_window` is on, caps the served context at the window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tserve.model.config import DecoderConfig
from tserve.model.importers.common import unsupported
from tserve.model.importers.llama import decoder_config, generation, weights

MODEL_TYPES = ("smollm3",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    bias = bool(raw.get("attention_bias", False))
    sliding = raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or [])
    window = raw.get("sliding_window") if sliding else None
    cfg = decoder_config(raw, path, qkv_bias=bias, out_bias=bias, sliding_window=window)
    flags = raw.get("no_rope_layers")
    if flags is None:  # SmolLM3Config's default: every `no_rope_layer_interval`-th layer without positions
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(cfg.n_layers)]
    if not isinstance(flags, list) or len(flags) != cfg.n_layers or any(f not in (0, 1) for f in flags):
        raise unsupported(path, "no_rope_layers", flags, f"one 0 or 1 per layer ({cfg.n_layers})")
    return replace(cfg, nope_layers=[i for i, rotates in enumerate(flags) if not rotates])
