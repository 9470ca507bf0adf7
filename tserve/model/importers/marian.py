"""Marian (`MarianMTModel`, the opus-mt layout): post-norm encoder-decoder, sinusoidal positions, one shared
vocabulary, and decoding defaults from generation_config.json."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tserve.model.config import Seq2SeqConfig
from tserve.model.importers.base import CheckpointError, GenerationDefaults, WeightSource, hf_generation
from tserve.model.importers.common import activation

MODEL_TYPES = ("marian",)


def config(raw: dict[str, Any], path: Path) -> Seq2SeqConfig:
    cfg_file = path / "config.json"
    if not raw.get("share_encoder_decoder_embeddings", True) or raw.get("decoder_vocab_size", raw["vocab_size"]) != raw["vocab_size"]:
        raise CheckpointError(f"{cfg_file}: Marian models with separate source/target vocabularies are not supported")
    if raw["encoder_attention_heads"] != raw["decoder_attention_heads"] or raw["encoder_ffn_dim"] != raw["decoder_ffn_dim"]:
        raise CheckpointError(f"{cfg_file}: encoder and decoder must share head count and FFN width")
    if raw.get("normalize_before") or raw.get("add_final_layer_norm") or raw.get("normalize_embedding"):
        raise CheckpointError(f"{cfg_file}: pre-norm Marian variants are not supported")
    return Seq2SeqConfig(
        vocab_size=raw["vocab_size"], d_model=raw["d_model"], n_heads=raw["encoder_attention_heads"],
        d_ff=raw["encoder_ffn_dim"], n_encoder_layers=raw["encoder_layers"], n_decoder_layers=raw["decoder_layers"],
        max_source_len=raw["max_position_embeddings"], max_target_len=raw["max_position_embeddings"],
        norm_placement="post", norm_eps=1e-5, activation=activation(raw, "activation_function", "swish", path),
        positions="sinusoidal", tie_embeddings=True, scale_embeddings=bool(raw.get("scale_embedding", False)),
        final_norm=False, final_logits_bias=True, decoder_start_token_id=raw["decoder_start_token_id"],
        eos_token_id=raw["eos_token_id"], pad_token_id=raw["pad_token_id"],
    )


def generation(raw: dict[str, Any], path: Path) -> GenerationDefaults:
    gen = hf_generation(path, raw)
    banned = [i for ids in (gen.get("bad_words_ids") or []) for i in ids if len(ids) == 1]
    max_length = gen.get("max_length") or 128
    return GenerationDefaults(
        num_beams=int(gen.get("num_beams") or 1),
        max_new_tokens=int(gen.get("max_new_tokens") or max_length - 1),
        length_penalty=float(gen.get("length_penalty", 1.0)),
        early_stopping=gen.get("early_stopping", False),
        banned_token_ids=banned,
        force_eos_at_max=gen.get("forced_eos_token_id") is not None,
        # What `python -m tserve.training align` chose for this checkpoint (kept where Whisper's checkpoints keep theirs)
        alignment_heads=[[int(layer), int(head)] for layer, head in gen.get("alignment_heads") or []],
        alignment_offset=int(gen.get("alignment_offset") or 0),
    )


def weights(cfg: Seq2SeqConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    yield "tok_emb.weight", shared_embedding(hf)
    yield "final_logits_bias", hf["final_logits_bias"].reshape(-1)
    yield from layer_weights(cfg, hf)


def shared_embedding(hf: WeightSource) -> Tensor:
    """The BART layout's one embedding (`model.` stripped): `shared`, or the encoder's where only it is stored."""
    hf.strip_prefix("model.")
    shared = hf.get("shared.weight")
    if shared is None:
        shared = hf.get("encoder.embed_tokens.weight")
    if shared is None:
        raise CheckpointError(f"{hf.file}: no shared embedding found")
    return shared


def layer_weights(cfg: Seq2SeqConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    """The encoder and decoder layers of the BART layout (Marian, M2M100 / NLLB), `model.` stripped."""

    def attention(theirs: str, ours: str, fused: str) -> Iterator[tuple[str, Tensor]]:
        w = [hf[f"{theirs}.{n}_proj.weight"] for n in "qkv"]
        b = [hf[f"{theirs}.{n}_proj.bias"] for n in "qkv"]
        if fused == "qkv":
            yield f"{ours}.qkv.weight", torch.cat(w)
            yield f"{ours}.qkv.bias", torch.cat(b)
        else:
            yield f"{ours}.q.weight", w[0]
            yield f"{ours}.q.bias", b[0]
            yield f"{ours}.kv.weight", torch.cat(w[1:])
            yield f"{ours}.kv.bias", torch.cat(b[1:])
        yield f"{ours}.proj.weight", hf[f"{theirs}.out_proj.weight"]
        yield f"{ours}.proj.bias", hf[f"{theirs}.out_proj.bias"]

    def copy(theirs: str, ours: str) -> Iterator[tuple[str, Tensor]]:
        for p in ("weight", "bias"):
            yield f"{ours}.{p}", hf[f"{theirs}.{p}"]

    for side, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n):
            theirs, ours = f"{side}.layers.{i}", f"{side}.{i}"
            yield from attention(f"{theirs}.self_attn", f"{ours}.attn", "qkv")
            yield from copy(f"{theirs}.self_attn_layer_norm", f"{ours}.norm1")
            if side == "decoder":
                yield from attention(f"{theirs}.encoder_attn", f"{ours}.cross_attn", "kv")
                yield from copy(f"{theirs}.encoder_attn_layer_norm", f"{ours}.norm_cross")
            yield from copy(f"{theirs}.fc1", f"{ours}.mlp.fc1")
            yield from copy(f"{theirs}.fc2", f"{ours}.mlp.fc2")
            yield from copy(f"{theirs}.final_layer_norm", f"{ours}.norm2")
