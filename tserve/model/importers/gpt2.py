"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, gelu_tanh MLP, fused QKV in Conv1D layout."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

from tserve.model.config import DecoderConfig
from tserve.model.importers.base import CheckpointError, GenerationDefaults, WeightSource
from tserve.model.importers.common import activation

MODEL_TYPES = ("gpt2",)


def config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
        raise CheckpointError(f"{path / 'config.json'}: GPT-2 attention variants are not supported")
    d = raw["n_embd"]
    return DecoderConfig(
        vocab_size=raw["vocab_size"], d_model=d, n_heads=raw["n_head"], n_layers=raw["n_layer"],
        d_ff=raw.get("n_inner") or 4 * d, max_seq_len=raw["n_positions"], norm_eps=raw["layer_norm_epsilon"],
        activation=activation(raw, "activation_function", "gelu_new", path), positions="learned",
        tie_embeddings=raw.get("tie_word_embeddings", True), bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"), pad_token_id=raw.get("pad_token_id"),
    )


def generation(raw: dict[str, Any], path: Path) -> GenerationDefaults:
    # GPT-2's config says max_length 20 (an old pipeline default), not a property of the model.
    return GenerationDefaults(max_new_tokens=128)


def weights(cfg: DecoderConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    hf.strip_prefix("transformer.")
    yield "tok_emb.weight", hf["wte.weight"]
    yield "pos_emb.weight", hf["wpe.weight"]
    yield "norm_f.weight", hf["ln_f.weight"]
    yield "norm_f.bias", hf["ln_f.bias"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", hf["lm_head.weight"]
    # GPT-2's Conv1D stores weights as (in, out): transposed onto nn.Linear's (out, in).
    names = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for i in range(cfg.n_layers):
        for theirs, ours in names.items():
            yield f"blocks.{i}.{ours}.weight", hf[f"h.{i}.{theirs}.weight"].t()
            yield f"blocks.{i}.{ours}.bias", hf[f"h.{i}.{theirs}.bias"]
        for theirs, ours in (("ln_1", "norm1"), ("ln_2", "norm2")):
            for p in ("weight", "bias"):
                yield f"blocks.{i}.{ours}.{p}", hf[f"h.{i}.{theirs}.{p}"]
