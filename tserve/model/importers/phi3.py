"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): the Llama layout (model.importers.llama) with q, k and v in
one stored projection (`qkv_proj`) and the MLP's gate and up projections in another (`gate_up_proj`, gate first);
LongRoPE (`rope_scaling` type "longrope", or "su" in early configs: short and long factors, model.rope) and
partial rotary (`partial_rotary_factor`, Phi-4-mini: 0.75); every layer attends within `sliding_window` when the
config sets one (Phi-3-mini-4k: 2047)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

from tserve.model.config import DecoderConfig
from tserve.model.importers.base import WeightSource
from tserve.model.importers.llama import decoder_config, generation, outer_weights, sliding_layers

MODEL_TYPES = ("phi3",)
__all__ = ["MODEL_TYPES", "config", "generation", "weights"]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    bias = bool(raw.get("attention_bias", False))
    return decoder_config(raw, path, qkv_bias=bias, out_bias=bias,
                          sliding=sliding_layers(raw, raw["num_hidden_layers"], default_all=True))


def weights(cfg: DecoderConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    yield from outer_weights(cfg, hf)
    for i in range(cfg.n_layers):
        theirs, ours = f"layers.{i}", f"blocks.{i}"
        yield f"{ours}.attn.qkv.weight", hf[f"{theirs}.self_attn.qkv_proj.weight"]  # q, k, v: our order too
        yield f"{ours}.attn.proj.weight", hf[f"{theirs}.self_attn.o_proj.weight"]
        if cfg.qkv_bias:
            yield f"{ours}.attn.qkv.bias", hf[f"{theirs}.self_attn.qkv_proj.bias"]
            yield f"{ours}.attn.proj.bias", hf[f"{theirs}.self_attn.o_proj.bias"]
        yield f"{ours}.norm1.weight", hf[f"{theirs}.input_layernorm.weight"]
        yield f"{ours}.norm2.weight", hf[f"{theirs}.post_attention_layernorm.weight"]
        gate, up = hf[f"{theirs}.mlp.gate_up_proj.weight"].chunk(2, dim=0)
        yield f"{ours}.mlp.gate.weight", gate
        yield f"{ours}.mlp.fc1.weight", up
        yield f"{ours}.mlp.fc2.weight", hf[f"{theirs}.mlp.down_proj.weight"]
