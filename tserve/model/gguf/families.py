"""GGUF architectures as the Hugging Face checkpoints our importers read: `general.architecture`'s metadata
(`llama.*`, `qwen2.*`, ...) becomes the config.json dict of the family's `model_type`, and llama.cpp's tensor
names (`blk.N.attn_q.weight`, ...) the names `save_pretrained` writes, so the importers in
`model.importers` map them as they map any Hugging Face directory.

A family is one `Family` entry of `FAMILIES`: its `model_type`, whether llama.cpp's converter reordered its
q/k rows (`permuted_qk`), and a function adding what only that family's config says."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tserve.model.importers.base import CheckpointError

Metadata = dict[str, Any]

# llama.cpp's names -> Hugging Face's, for the Llama layout (every family so far).
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives from the config; read into the config, never weights of ours.
CONFIG_TENSORS = ("rope_freqs.weight",)


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name; None for one no importer reads."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(tensor: Any, n_heads: int) -> Any:
    """Undo llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py) of a q or k projection's rows (weight or
    bias): it stores each head's rotary pairs as (first halves, second halves) interleaved, (x0, x(d/2), x1, ...)
    -> (x0, x1, ...), for its own rotary layout; ours rotates halves, as Hugging Face's does. `n_heads`: query
    heads for q, kv heads for k."""
    rows = tensor.shape[0]
    return (tensor.reshape(n_heads, rows // n_heads // 2, 2, *tensor.shape[1:])
            .swapaxes(1, 2).reshape(tensor.shape))


@dataclass(frozen=True)
class Family:
    model_type: str  # the importer (`model.importers`) its config is written for
    permuted_qk: bool = False  # llama.cpp's converter reorders q/k rows of this architecture (`unpermute_qk`)
    # Config fields only this family has, from (metadata, architecture, the shared fields).
    extra: Callable[[Metadata, str, dict[str, Any]], dict[str, Any]] = field(default=lambda meta, arch, raw: {})


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", permuted_qk=True),  # Llama 2 / 3.x, Mistral, SmolLM, TinyLlama: all "llama" in GGUF
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),  # per-head q/k norms (the importer reads them), head_dim from key_length
}


def family_of(meta: Metadata, file: object) -> tuple[str, Family]:
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise CheckpointError(f"{file}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(sorted(FAMILIES))})")
    return arch, FAMILIES[arch]


def _one(meta: Metadata, key: str, file: object, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, list):  # per-layer values (head counts of some models): one for every layer only
        if len(set(value)) != 1:
            raise CheckpointError(f"{file}: {key} differs between layers ({value[:8]}...), which the Llama "
                                  f"layout does not take")
        value = value[0]
    if value is None:
        raise CheckpointError(f"{file}: GGUF metadata {key!r} is missing")
    return value


def hf_config(meta: Metadata, tensors: dict[str, Any], file: object,
              rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """config.json's fields for the family's importer, from the metadata (and llama.cpp's `rope_freqs`,
    where it stored Llama 3's rope scaling as per-frequency factors)."""
    arch, family = family_of(meta, file)
    heads = int(_one(meta, f"{arch}.attention.head_count", file))
    hidden = int(_one(meta, f"{arch}.embedding_length", file))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{file}: {arch}.attention.value_length differs from key_length, which the Llama "
                              f"layout does not take")
    if (rotary := meta.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{file}: {arch}.rope.dimension_count {rotary} of a head of {head_dim}: rotary "
                              f"embeddings over the whole head only")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    context = int(_one(meta, f"{arch}.context_length", file))
    raw: dict[str, Any] = {
        "model_type": family.model_type, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": int(_one(meta, f"{arch}.attention.head_count_kv", file, heads)),
        "head_dim": head_dim, "intermediate_size": int(_one(meta, f"{arch}.feed_forward_length", file)),
        "num_hidden_layers": int(_one(meta, f"{arch}.block_count", file)),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors
        else len(meta.get("tokenizer.ggml.tokens", [])),
        "max_position_embeddings": context,
        "rms_norm_eps": float(_one(meta, f"{arch}.attention.layer_norm_rms_epsilon", file)),
        "hidden_act": "silu", "rope_theta": theta,
        "rope_scaling": rope_scaling(meta, arch, file, rope_freqs, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors, "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return raw | family.extra(meta, arch, raw)


def rope_scaling(meta: Metadata, arch: str, file: object, rope_freqs: np.ndarray | None, theta: float,
                 head_dim: int) -> dict[str, Any] | None:
    """`rope.scaling.*` as Hugging Face's rope_scaling; Llama 3's from `rope_freqs` (`llama3_from_factors`)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_freqs is not None:
        if kind not in ("none", "llama3"):
            raise CheckpointError(f"{file}: both rope_freqs and rope.scaling.type {kind!r}")
        return llama3_from_factors(rope_freqs, theta, head_dim, file)
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    if (original := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling  # a type we do not implement is the importer's CheckpointError, named there


def llama3_factors(scaling: dict[str, float], theta: float, head_dim: int) -> np.ndarray:
    """The factor each rotary frequency is divided by under Llama 3's scaling (as llama.cpp's converter
    writes them into `rope_freqs`, and as transformers' `_compute_llama3_parameters` applies them)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def llama3_from_factors(factors: np.ndarray, theta: float, head_dim: int, file: object) -> dict[str, Any]:
    """Llama 3's rope_scaling back from llama.cpp's per-frequency factors. The factor is the largest; with
    Llama 3's low / high frequency factors (1, 4: every release's), a frequency between the two bounds gives
    the original context. The result is checked by recomputing the factors from it."""
    factors = np.asarray(factors, dtype=np.float64)
    if factors.shape != (head_dim // 2,):
        raise CheckpointError(f"{file}: rope_freqs has shape {list(factors.shape)}, expected [{head_dim // 2}]")
    factor = float(factors.max())
    wavelens = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low, high = 1.0, 4.0
    between = [(w, f) for w, f in zip(wavelens, factors, strict=True) if not (np.isclose(f, 1) or np.isclose(f, factor))]
    if between:
        w, f = between[0]
        smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
        old = w * (low + smooth * (high - low))
    else:  # no frequency between: any original context that puts each on its side gives the same factors
        ones = [w for w, f in zip(wavelens, factors, strict=True) if np.isclose(f, 1)]
        old = high * max(ones) * (1 + 1e-6) if ones else float(wavelens[0]) * low * (1 - 1e-6)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": round(old) if abs(old - round(old)) < 1e-3 else old}
    if not np.allclose(llama3_factors(scaling, theta, head_dim), factors, rtol=1e-5, atol=1e-6):
        raise CheckpointError(f"{file}: rope_freqs {np.round(factors, 4).tolist()} are not Llama 3's rope scaling "
                              f"with low / high frequency factors 1 and 4, the only per-frequency factors read")
    return scaling
