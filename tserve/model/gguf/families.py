"""GGUF architectures as the Hugging Face checkpoints our importers read: `general.architecture`'s metadata
(`llama.*`, `qwen2.*`, ...) becomes the config.json dict of the family's `model_type`, and llama.cpp's tensor
names (`blk.N.attn_q.weight`, ...) the names `save_pretrained` writes, so the importers in
`model.importers` map them as they map any Hugging Face directory.

A family is one `Family` entry of `FAMILIES`: its `model_type`, whether llama.cpp's converter reordered its
q/k rows (`permuted_qk`), the tensor names where its layout differs from Llama's, what the converter added to its
norm weights, and a function adding what only that family's config says. What llama.cpp hard-codes for an
architecture rather than storing it (Gemma's attention scale and sliding pattern) is read as llama.cpp reads it:
a file means what llama.cpp runs."""

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
# Gemma 2 / 3: a norm on either side of each sub-layer; `ffn_norm` is the one before the MLP.
GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3: q, k, v in one stored projection, and `ffn_up` is the MLP's gate and up projections (gate first).
PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Tensors llama.cpp derives from the config; read into the config, never weights of ours.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(name: str, family: Family) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name of `family`; None for one no importer reads."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    names = BLOCK_NAMES | family.names
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
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
    names: dict[str, str] = field(default_factory=dict)  # block tensor names that differ from `BLOCK_NAMES`
    # What llama.cpp's converter added to every `*norm.weight` (Gemma's (1 + w) norms stored as 1 + w): taken off
    # again, since the importer applies the offset itself.
    norm_shift: float = 0.0
    # Config fields only this family has, from (metadata, architecture, the shared fields).
    extra: Callable[[Metadata, str, dict[str, Any]], dict[str, Any]] = field(default=lambda meta, arch, raw: {})


def _gemma(meta: Metadata, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3 as llama.cpp's `llama_model_gemma2` / `gemma3` read them. Not stored, hard-coded there: the
    attention scale (1 / sqrt(head size), or 1 / sqrt(hidden / heads) for the 27B models, told apart by their layer
    count: query_pre_attn_scalar), the sliding pattern unless `attention.sliding_window_pattern` is stored (Gemma
    2: every other layer, Gemma 3: five of six) and the window (Gemma 2: 4096 unless stored; Gemma 3: none unless
    stored), Gemma 2's soft caps where absent (50, 30). The rope base of sliding layers: `rope.freq_base_swa`, else
    Gemma 2's global base (its scaling too), Gemma 3's 10000 (unscaled)."""
    gemma2 = arch == "gemma2"
    n, hidden, heads = raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"]
    scalar = hidden // heads if n == (46 if gemma2 else 62) else raw["head_dim"]
    window = int(meta.get(f"{arch}.attention.sliding_window", 4096 if gemma2 else 0))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if gemma2 else 6)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise CheckpointError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {n} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's `set_swa_pattern(n, dense_first=false)`: the last of every n layers is global
        pattern = int(pattern)
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
    softcaps = {"attn_logit_softcapping": float(meta.get(f"{arch}.attn_logit_softcapping", 50.0)) if gemma2 else None,
                "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping", 30.0 if gemma2 else None) or None}
    out = {"model_type": "gemma2" if gemma2 else "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": scalar, "sliding_window": window or None,
           "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]} | softcaps
    if gemma2 and f"{arch}.rope.freq_base_swa" not in meta:
        return out  # one rope for every layer
    full = {"rope_theta": raw["rope_theta"]} | (raw["rope_scaling"] or {"rope_type": "default"})
    local = ({"rope_theta": float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))}
             | ((raw["rope_scaling"] or {}) if gemma2 else {}))
    local.setdefault("rope_type", "default")
    return out | {"rope_theta": None, "rope_scaling": None,
                  "rope_parameters": {"full_attention": full, "sliding_attention": local}}


def _phi3(meta: Metadata, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini: the sliding window as stored (0: none; llama.cpp does not apply it yet, transformers
    does); LongRoPE from the `rope_factors_long` / `rope_factors_short` tensors (`hf_config`)."""
    return {"sliding_window": int(meta.get(f"{arch}.attention.sliding_window", 0)) or None}


def _granite(meta: Metadata, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers under llama.cpp's names (`embedding_scale`, `attention.scale`, `residual_scale`,
    `logit_scale`); a scale absent or 0 is llama.cpp's "none". A file whose rope is switched off
    (`rope.scaling.finetuned` false: Granite 4's layers without positions) is not the Llama layout's."""
    if meta.get(f"{arch}.rope.scaling.finetuned", True) is False:
        raise CheckpointError(f"{arch}.rope.scaling.finetuned is false (no rotary positions), which the Llama "
                              f"layout does not take")
    scales = {"embedding_multiplier": "embedding_scale", "attention_multiplier": "attention.scale",
              "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}
    return {hf: float(v) for hf, key in scales.items() if (v := meta.get(f"{arch}.{key}"))}


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", permuted_qk=True),  # Llama 2 / 3.x, Mistral, SmolLM, TinyLlama: all "llama" in GGUF
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),  # per-head q/k norms (the importer reads them), head_dim from key_length
    "gemma2": Family("gemma2", names=GEMMA_NAMES, norm_shift=1.0, extra=_gemma),
    "gemma3": Family("gemma3_text", names=GEMMA_NAMES, norm_shift=1.0, extra=_gemma),
    "phi3": Family("phi3", names=PHI3_NAMES, extra=_phi3),  # Phi-3 / 3.5, Phi-4-mini
    "granite": Family("granite", permuted_qk=True, extra=_granite),  # converted as Llama: q/k rows reordered
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
              config_tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """config.json's fields for the family's importer, from the metadata and the `CONFIG_TENSORS` the file has
    (llama.cpp's `rope_freqs`, where it stored Llama 3's rope scaling as per-frequency factors; Phi-3's LongRoPE
    factors)."""
    arch, family = family_of(meta, file)
    heads = int(_one(meta, f"{arch}.attention.head_count", file))
    hidden = int(_one(meta, f"{arch}.embedding_length", file))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{file}: {arch}.attention.value_length differs from key_length, which the Llama "
                              f"layout does not take")
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    # Part of each head rotated (Phi-4-mini): the first `rotary` dimensions, in halves, as transformers' partial
    # rotary. Not where the converter reordered q/k rows, which it did over the whole head.
    if not 0 < rotary <= head_dim or rotary % 2 or (rotary != head_dim and family.permuted_qk):
        raise CheckpointError(f"{file}: {arch}.rope.dimension_count {rotary} of a head of {head_dim}: rotary "
                              f"embeddings over an even part of the head only, and over the whole head of the "
                              f"{arch} architecture")
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
        "rope_scaling": rope_scaling(meta, arch, file, config_tensors, theta, rotary, context),
        "partial_rotary_factor": rotary / head_dim,
        "tie_word_embeddings": "output.weight" not in tensors,
        # the biases of q, k and v apart, or fused into one attn_qkv (llama.cpp's converter with --fuse-qkv)
        "attention_bias": any(f"blk.0.{n}.bias" in tensors for n in ("attn_q", "attn_qkv")),
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return raw | family.extra(meta, arch, raw)


def rope_scaling(meta: Metadata, arch: str, file: object, config_tensors: dict[str, np.ndarray], theta: float,
                 rotary: int, context: int) -> dict[str, Any] | None:
    """`rope.scaling.*` as Hugging Face's rope_scaling; Llama 3's from `rope_freqs` (`llama3_from_factors`),
    LongRoPE's from `rope_factors_long` / `rope_factors_short` (`longrope_from_factors`)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if (rope_freqs := config_tensors.get("rope_freqs.weight")) is not None:
        if kind not in ("none", "llama3"):
            raise CheckpointError(f"{file}: both rope_freqs and rope.scaling.type {kind!r}")
        return llama3_from_factors(rope_freqs, theta, rotary, file)
    if "rope_factors_long.weight" in config_tensors or kind == "longrope":
        return longrope_from_factors(meta, arch, file, config_tensors, rotary, context)
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    if (original := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling  # a type we do not implement is the importer's CheckpointError, named there


def longrope_from_factors(meta: Metadata, arch: str, file: object, config_tensors: dict[str, np.ndarray],
                          rotary: int, context: int) -> dict[str, Any]:
    """LongRoPE (Phi-3's "longrope" / "su") as llama.cpp's converter stores it: the long and short factors as
    tensors of one factor per rotated frequency, the original context and the attention factor as metadata."""
    factors = {k: config_tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short")}
    for k, f in factors.items():
        if f is None or f.shape != (rotary // 2,):
            raise CheckpointError(f"{file}: LongRoPE needs rope_factors_{k} of [{rotary // 2}] factors (one per "
                                  f"rotated frequency); the file has {None if f is None else list(f.shape)}")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise CheckpointError(f"{file}: LongRoPE needs {arch}.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors["long"].tolist(),
                               "short_factor": factors["short"].tolist(),
                               "original_max_position_embeddings": int(original), "factor": context / int(original)}
    if (attention := meta.get(f"{arch}.rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


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
