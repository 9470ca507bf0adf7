"""Llama (`LlamaForCausalLM`: Llama 2 / 3.x, SmolLM / SmolLM2, TinyLlama), and the layout Mistral, Qwen2 and
Qwen3 share with it: RMSNorm pre-norm blocks, rotary positions (with `rope_scaling`), grouped-query
attention, a SwiGLU MLP and no biases unless the config asks for them.

Config fields read: hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
num_hidden_layers, vocab_size, max_position_embeddings, rms_norm_eps, hidden_act (silu), rope_theta and
rope_scaling (the classic layout) or rope_parameters (what current transformers writes; rope_scaling wins
when both are there), partial_rotary_factor, attention_bias, mlp_bias, tie_word_embeddings, bos/eos/pad_token_id;
sliding_window and layer_types where a family slides.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tserve.model import rope
from tserve.model.config import DecoderConfig
from tserve.model.importers.base import GenerationDefaults, WeightSource, eos_ids, hf_generation
from tserve.model.importers.common import unsupported

MODEL_TYPES = ("llama",)


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    bias = bool(raw.get("attention_bias", False))
    return decoder_config(raw, path, qkv_bias=bias, out_bias=bias)


def rope_settings(raw: dict[str, Any], path: Path, layer_type: str | None = None
                  ) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling or None, the fraction of each head that rotates) from either layout; `layer_type`: the
    per-layer-type rope parameters of a family that has them (Gemma 3's "full_attention", "sliding_attention")."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    key = "rope_parameters"
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params, key = params[layer_type], f"rope_parameters.{layer_type}"
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        key = "rope_scaling"
    if scaling is not None and not isinstance(scaling, dict):
        raise unsupported(path, key, scaling, "expected an object")
    partial = float((scaling or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0)
    if not 0.0 < partial <= 1.0:
        raise unsupported(path, "partial_rotary_factor", partial, "a fraction of the head in (0, 1]")
    kind = rope.scaling_type(scaling)
    if kind == "default":
        return theta, None, partial
    scaling = {k: v for k, v in scaling.items() if k not in ("type", "partial_rotary_factor")} | {"rope_type": kind}
    if kind == "dynamic":
        scaling["max_position_embeddings"] = raw["max_position_embeddings"]
    if kind == "longrope":  # as transformers: the original context from the config, factor = context / it
        original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None and original:
            scaling["factor"] = raw["max_position_embeddings"] / original
    try:
        rope.check_scaling(scaling)
    except ValueError as exc:
        raise unsupported(path, f"{key}.rope_type", kind, str(exc)) from exc
    return theta, scaling, partial


def sliding_layers(raw: dict[str, Any], n_layers: int, *, default_all: bool) -> list[int]:
    """The layers that attend within `sliding_window`: those `layer_types` marks "sliding_attention", or, without
    it, every layer (`default_all`: Mistral, Phi-3) or none."""
    if not raw.get("sliding_window"):
        return []
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return list(range(n_layers)) if default_all else []


def decoder_config(raw: dict[str, Any], path: Path, *, qkv_bias: bool, out_bias: bool, qk_norm: bool = False,
                   sliding: list[int] | None = None, activation: str = "swiglu") -> DecoderConfig:
    """The Llama layout's config; each family says its biases, q/k norm and which layers slide (`sliding`, within
    `sliding_window`)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    expected = {"swiglu": ("silu",), "gated_gelu_tanh": ("gelu_pytorch_tanh", "gelu_new")}[activation]
    if act not in expected:
        raise unsupported(path, "hidden_act", act, f"this family's MLP is gated with {' or '.join(expected)}")
    theta, scaling, partial = rope_settings(raw, path)
    context = int(raw["max_position_embeddings"])
    if scaling and scaling["rope_type"] == "dynamic":
        context = int(context * float(scaling["factor"]))  # what dynamic NTK scaling is for
    eos = eos_ids(raw.get("eos_token_id"))
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    rotary_dim = int(head_dim * partial)
    return DecoderConfig(
        vocab_size=raw["vocab_size"], d_model=raw["hidden_size"], n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim, d_ff=raw["intermediate_size"],
        n_layers=raw["num_hidden_layers"], max_seq_len=context, norm="rmsnorm",
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), activation=activation, bias=False, qkv_bias=qkv_bias,
        out_bias=out_bias, mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=qk_norm, positions="rope",
        rope_base=theta, rope_scaling=scaling, rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        sliding_window=raw.get("sliding_window") if sliding else None, sliding_layers=sliding or [],
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=eos[0] if eos else None,
        pad_token_id=raw.get("pad_token_id"),
    )


def qwen_sliding(raw: dict[str, Any]) -> list[int]:
    """Qwen2/Qwen3 (and SmolLM3): a window only with `use_sliding_window`, on the layers `layer_types` marks or,
    without it, those from `max_window_layers` on (as transformers' configs default it)."""
    if not (raw.get("use_sliding_window") and raw.get("sliding_window")):
        return []
    n = raw["num_hidden_layers"]
    if isinstance(raw.get("layer_types"), list):
        return sliding_layers(raw, n, default_all=False)
    return list(range(int(raw.get("max_window_layers", 0)), n))


def generation(raw: dict[str, Any], path: Path) -> GenerationDefaults:
    """Every eos id of generation_config.json (Llama 3 instruct models list three) ends a sequence."""
    return GenerationDefaults(eos_token_ids=eos_ids(hf_generation(path, raw).get("eos_token_id")))


def outer_weights(cfg: DecoderConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    """The embeddings, the final norm and an untied output layer: the same names in every family of the layout."""
    hf.strip_prefix("model.")
    yield "tok_emb.weight", hf["embed_tokens.weight"]
    yield "norm_f.weight", hf["norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", hf["lm_head.weight"]


def weights(cfg: DecoderConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    yield from outer_weights(cfg, hf)
    for i in range(cfg.n_layers):
        theirs, ours = f"layers.{i}", f"blocks.{i}"
        # q, k and v in one projection, in that order (model.attention splits them by width).
        yield f"{ours}.attn.qkv.weight", torch.cat([hf[f"{theirs}.self_attn.{n}_proj.weight"] for n in "qkv"])
        if cfg.qkv_bias:
            yield f"{ours}.attn.qkv.bias", torch.cat([hf[f"{theirs}.self_attn.{n}_proj.bias"] for n in "qkv"])
        yield f"{ours}.attn.proj.weight", hf[f"{theirs}.self_attn.o_proj.weight"]
        if cfg.out_bias:
            yield f"{ours}.attn.proj.bias", hf[f"{theirs}.self_attn.o_proj.bias"]
        if cfg.qk_norm:
            yield f"{ours}.attn.q_norm.weight", hf[f"{theirs}.self_attn.q_norm.weight"]
            yield f"{ours}.attn.k_norm.weight", hf[f"{theirs}.self_attn.k_norm.weight"]
        yield f"{ours}.norm1.weight", hf[f"{theirs}.input_layernorm.weight"]
        if cfg.sandwich_norms:  # Gemma 2/3: post_attention_layernorm is the attention output's own norm
            yield f"{ours}.norm1_out.weight", hf[f"{theirs}.post_attention_layernorm.weight"]
            yield f"{ours}.norm2.weight", hf[f"{theirs}.pre_feedforward_layernorm.weight"]
            yield f"{ours}.norm2_out.weight", hf[f"{theirs}.post_feedforward_layernorm.weight"]
        else:
            yield f"{ours}.norm2.weight", hf[f"{theirs}.post_attention_layernorm.weight"]
        for theirs_mlp, ours_mlp in (("up_proj", "fc1"), ("gate_proj", "gate"), ("down_proj", "fc2")):
            yield f"{ours}.mlp.{ours_mlp}.weight", hf[f"{theirs}.mlp.{theirs_mlp}.weight"]
            if cfg.mlp_bias:
                yield f"{ours}.mlp.{ours_mlp}.bias", hf[f"{theirs}.mlp.{theirs_mlp}.bias"]
