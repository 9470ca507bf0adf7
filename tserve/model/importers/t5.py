"""T5 (`T5ForConditionalGeneration`: T5 v1.0 and v1.1, FLAN-T5, MADLAD-400): pre-norm RMS layer norms without
a mean or bias, no position embeddings but a learned relative position bias on the self-attention scores
(one table per stack, stored in its first layer), unscaled attention scores, a ReLU or gated-GELU MLP, one
embedding shared by both stacks, and an output layer that is the embedding scaled by d_model^-0.5 (tied) or a
matrix of its own (v1.1). MADLAD-400 picks the target language with a `<2de>` tag in front of the source."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tserve.model.config import Seq2SeqConfig
from tserve.model.importers.base import CheckpointError, GenerationDefaults, WeightSource
from tserve.model.importers.common import unsupported
from tserve.model.importers.marian import generation as marian_generation

MODEL_TYPES = ("t5",)

# feed_forward_proj -> our activation (T5's "gated-gelu" is GPT-2's tanh GELU, gated).
_FEED_FORWARD = {"relu": "relu", "gelu": "gelu", "gated-gelu": "gated_gelu_tanh", "gated-silu": "swiglu"}


def config(raw: dict[str, Any], path: Path) -> Seq2SeqConfig:
    proj = raw.get("feed_forward_proj", "relu")
    if proj not in _FEED_FORWARD:
        raise unsupported(path, "feed_forward_proj", proj, f"supported: {', '.join(_FEED_FORWARD)}")
    tied = bool(raw.get("tie_word_embeddings", True))
    # transformers writes `scale_decoder_outputs` where it differs from the tying (v1.1 saved tied).
    scaled = bool(raw.get("scale_decoder_outputs", tied))
    max_len = int(raw.get("n_positions") or 512)  # no position table: what the caches are sized for
    return Seq2SeqConfig(
        vocab_size=raw["vocab_size"], d_model=raw["d_model"], n_heads=raw["num_heads"], head_dim=raw["d_kv"],
        d_ff=raw["d_ff"], n_encoder_layers=raw["num_layers"],
        n_decoder_layers=raw.get("num_decoder_layers") or raw["num_layers"],
        max_source_len=max_len, max_target_len=max_len, norm="rmsnorm", norm_placement="pre",
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-6)), activation=_FEED_FORWARD[proj], bias=False,
        positions="relative", relative_buckets=int(raw.get("relative_attention_num_buckets", 32)),
        relative_max_distance=int(raw.get("relative_attention_max_distance", 128)), tie_embeddings=tied,
        scale_embeddings=False, final_norm=True, final_logits_bias=False,
        output_scale=raw["d_model"] ** -0.5 if scaled else 1.0,
        decoder_start_token_id=raw.get("decoder_start_token_id", 0), eos_token_id=_eos(raw, path),
        pad_token_id=raw.get("pad_token_id", 0),
    )


def _eos(raw: dict[str, Any], path: Path) -> int:
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        if len(eos) != 1:
            raise unsupported(path, "eos_token_id", eos, "a translator stops on one token")
        eos = eos[0]
    return int(eos)


def generation(raw: dict[str, Any], path: Path) -> GenerationDefaults:
    return marian_generation(raw, path)


def weights(cfg: Seq2SeqConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    shared = hf.get("shared.weight")
    if shared is None:
        shared = hf.get("encoder.embed_tokens.weight")
    if shared is None:
        raise CheckpointError(f"{hf.file}: no shared embedding (shared.weight) found")
    yield "tok_emb.weight", shared
    if not cfg.tie_embeddings:
        yield "lm_head.weight", hf["lm_head.weight"]
    yield "enc_rel_bias.table.weight", hf["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    yield "dec_rel_bias.table.weight", hf["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    # T5 does not divide scores by sqrt(d_kv) (its initialisation absorbs it); our attention does, so the query
    # projections are multiplied by sqrt(d_kv) here and every backend computes T5's scores.
    query_scale = math.sqrt(cfg.d_head)

    def attention(theirs: str, ours: str, cross: bool) -> Iterator[tuple[str, Tensor]]:
        q, k, v = (hf[f"{theirs}.{n}.weight"] for n in "qkv")
        q = (q.float() * query_scale).to(q.dtype)
        if cross:
            yield f"{ours}.q.weight", q
            yield f"{ours}.kv.weight", torch.cat((k, v))
        else:
            yield f"{ours}.qkv.weight", torch.cat((q, k, v))
        yield f"{ours}.proj.weight", hf[f"{theirs}.o.weight"]

    def mlp(theirs: str, ours: str) -> Iterator[tuple[str, Tensor]]:
        if cfg.activation in ("gated_gelu_tanh", "swiglu"):  # act(wi_0 x) * wi_1 x
            yield f"{ours}.gate.weight", hf[f"{theirs}.wi_0.weight"]
            yield f"{ours}.fc1.weight", hf[f"{theirs}.wi_1.weight"]
        else:
            yield f"{ours}.fc1.weight", hf[f"{theirs}.wi.weight"]
        yield f"{ours}.fc2.weight", hf[f"{theirs}.wo.weight"]

    for side, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n):
            theirs, ours = f"{side}.block.{i}.layer", f"{side}.{i}"
            yield from attention(f"{theirs}.0.SelfAttention", f"{ours}.attn", cross=False)
            yield f"{ours}.norm1.weight", hf[f"{theirs}.0.layer_norm.weight"]
            ff = 1
            if side == "decoder":
                yield from attention(f"{theirs}.1.EncDecAttention", f"{ours}.cross_attn", cross=True)
                yield f"{ours}.norm_cross.weight", hf[f"{theirs}.1.layer_norm.weight"]
                ff = 2
            yield from mlp(f"{theirs}.{ff}.DenseReluDense", f"{ours}.mlp")
            yield f"{ours}.norm2.weight", hf[f"{theirs}.{ff}.layer_norm.weight"]
    yield "enc_norm.weight", hf["encoder.final_layer_norm.weight"]
    yield "dec_norm.weight", hf["decoder.final_layer_norm.weight"]
