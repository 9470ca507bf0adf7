"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 (`Gemma3ForCausalLM`, and the text part of
`Gemma3ForConditionalGeneration`): the Llama layout (model.importers.llama) with

- RMSNorms that scale by (1 + weight), a second norm on each sub-layer's output (four per block), embeddings
  multiplied by sqrt(hidden_size), a GeGLU MLP (tanh GELU), scores scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers interleaved with global ones (`layer_types`; older configs: Gemma 2 every other layer,
  Gemma 3 five of every `sliding_window_pattern` = 6);
- Gemma 2: attention scores and final logits soft-capped (`attn_logit_softcapping`, `final_logit_softcapping`);
- Gemma 3: q/k norms, and a rope base of the sliding layers' own (`rope_local_base_freq`, or current
  transformers' `rope_parameters` per layer type), rope scaling on the global layers only.

The vision tower of a multimodal Gemma 3 checkpoint is not loaded: its text model serves text."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from tserve.model.config import DecoderConfig
from tserve.model.importers import llama
from tserve.model.importers.base import GenerationDefaults, WeightSource
from tserve.model.importers.common import unsupported

MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")
# Where transformers' Gemma3Config nests the text model (configs of every transformers version name it).
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("model_type") != "gemma3":
        return raw
    text = raw.get("text_config") or {}
    # A multimodal config's top level holds what its text model shares: the ids, tied embeddings.
    shared = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings") if k in raw}
    return {"model_type": "gemma3_text"} | shared | text


def _rope(raw: dict[str, Any], path: Path) -> tuple[tuple[float, dict | None], tuple[float, dict | None] | None]:
    """((base, scaling) of the global layers, that of the sliding layers or None: the same)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        per_type = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
        theta, scaling, _ = llama.rope_settings(per_type, path, "full_attention")
        local_theta, local_scaling, _ = llama.rope_settings(per_type, path, "sliding_attention")
        return (theta, scaling), (local_theta, local_scaling)
    theta, scaling, _ = llama.rope_settings(raw, path)
    if raw["model_type"] == "gemma2":
        return (theta, scaling), None
    return (theta, scaling), (float(raw.get("rope_local_base_freq", 10000.0)), None)


def _sliding(raw: dict[str, Any], path: Path) -> list[int]:
    n = raw["num_hidden_layers"]
    if not raw.get("sliding_window"):
        return []
    if isinstance(raw.get("layer_types"), list):
        if len(raw["layer_types"]) != n:
            raise unsupported(path, "layer_types", raw["layer_types"], f"one per layer ({n})")
        return llama.sliding_layers(raw, n, default_all=False)
    pattern = 2 if raw["model_type"] == "gemma2" else int(raw.get("sliding_window_pattern", 6))
    return [i for i in range(n) if (i + 1) % pattern]


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    raw = {"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"} | _text_config(raw)
    if raw.get("use_bidirectional_attention"):
        raise unsupported(path, "use_bidirectional_attention", True, "causal language models only")
    gemma3 = raw["model_type"] == "gemma3_text"
    bias = bool(raw.get("attention_bias", False))
    cfg = llama.decoder_config(raw, path, qkv_bias=bias, out_bias=bias, qk_norm=gemma3, sliding=_sliding(raw, path),
                               activation="gated_gelu_tanh")
    (theta, scaling), local = _rope(raw, path)
    scalar = raw.get("query_pre_attn_scalar") or cfg.d_head
    return replace(
        cfg, norm_weight_offset=1.0, sandwich_norms=True, scale_embeddings=True, attention_scale=float(scalar) ** -0.5,
        attention_softcap=raw.get("attn_logit_softcapping"), logit_softcap=raw.get("final_logit_softcapping"),
        rope_base=theta, rope_scaling=scaling, local_rope_base=local[0] if local else None,
        local_rope_scaling=local[1] if local else None,
    )


def generation(raw: dict[str, Any], path: Path) -> GenerationDefaults:
    return llama.generation(_text_config(raw), path)


def weights(cfg: DecoderConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    for prefix in _TEXT_PREFIXES:
        hf.strip_prefix(prefix)
    yield from llama.weights(cfg, hf)
