"""Importers for Hugging Face checkpoints: GPT-2 (`GPT2LMHeadModel`), Marian (`MarianMTModel`, the
opus-mt layout) and ViT (`ViTForImageClassification`). Each maps the HF config onto ours and renames the
weights onto our modules; only `model.safetensors` is read (pickled `pytorch_model.bin` is refused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.checkpoint import (
    TASKS,
    CheckpointError,
    GenerationDefaults,
    LoadedModel,
    build_model,
    load_state,
    read_safetensors,
    translation_languages,
)
from model.config import DecoderConfig, Seq2SeqConfig, ViTConfig
from model.preprocessing import ImagePreprocessing
from model.tokenizer import load_tokenizer

_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                   "swish": "silu", "silu": "silu"}


def load_hf(path: Path, raw: dict[str, Any], backend: str = "auto") -> LoadedModel:
    kind = raw.get("model_type")
    importers = {"gpt2": _gpt2, "marian": _marian, "vit": _vit}
    if kind not in importers:
        raise CheckpointError(
            f"{path / 'config.json'}: Hugging Face model_type {kind!r} is not supported (supported: gpt2, marian, vit)"
        )
    weights = path / "model.safetensors"
    if not weights.is_file():
        pickled = [p.name for p in path.glob("*.bin")]
        hint = f" ({', '.join(pickled)} found: pickled weights are not loaded; convert them to safetensors)" if pickled else ""
        raise CheckpointError(f"{weights}: missing{hint}")
    hf_state = read_safetensors(weights)
    try:
        config, state, extras = importers[kind](raw, hf_state, path)
    except KeyError as exc:
        raise CheckpointError(f"{weights}: expected tensor or config field {exc} not found") from exc
    model = build_model(config, backend)
    load_state(model, state, weights)
    loaded = LoadedModel(path, TASKS[config.architecture], config, model, source_format=f"hf-{kind}", **extras)
    if kind == "marian":
        loaded.languages = translation_languages(path, {})
    if kind in ("gpt2", "marian"):
        try:
            loaded.tokenizer = load_tokenizer(path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
    return loaded


def _act(name: str, path: Path) -> str:
    if name not in _HF_ACTIVATIONS:
        raise CheckpointError(f"{path / 'config.json'}: activation {name!r} is not supported")
    return _HF_ACTIVATIONS[name]


def _strip(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Drop a leading prefix (`transformer.`, `model.`, `vit.`) where the checkpoint has one."""
    if any(k.startswith(prefix) for k in state):
        return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    return state


def _generation_defaults(path: Path, raw: dict[str, Any]) -> GenerationDefaults:
    """HF keeps decoding defaults in generation_config.json (newer) or config.json (older)."""
    gen = dict(raw)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen.update(json.loads(gen_file.read_text()))
    banned = [i for ids in (gen.get("bad_words_ids") or []) for i in ids if len(ids) == 1]
    max_length = gen.get("max_length") or 128
    return GenerationDefaults(
        num_beams=int(gen.get("num_beams") or 1),
        max_new_tokens=int(gen.get("max_new_tokens") or max_length - 1),
        length_penalty=float(gen.get("length_penalty", 1.0)),
        early_stopping=gen.get("early_stopping", False),
        banned_token_ids=banned,
        force_eos_at_max=gen.get("forced_eos_token_id") is not None,
    )


# --------------------------------------------------------------------------------------------------
def _gpt2(raw: dict[str, Any], hf: dict[str, Tensor], path: Path):
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
        raise CheckpointError(f"{path / 'config.json'}: GPT-2 attention variants are not supported")
    d = raw["n_embd"]
    cfg = DecoderConfig(
        vocab_size=raw["vocab_size"], d_model=d, n_heads=raw["n_head"], n_layers=raw["n_layer"],
        d_ff=raw.get("n_inner") or 4 * d, max_seq_len=raw["n_positions"], norm_eps=raw["layer_norm_epsilon"],
        activation=_act(raw.get("activation_function", "gelu_new"), path), positions="learned",
        tie_embeddings=raw.get("tie_word_embeddings", True), bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"), pad_token_id=raw.get("pad_token_id"),
    )
    hf = _strip(hf, "transformer.")
    state = {"tok_emb.weight": hf["wte.weight"], "pos_emb.weight": hf["wpe.weight"],
             "norm_f.weight": hf["ln_f.weight"], "norm_f.bias": hf["ln_f.bias"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = hf["lm_head.weight"]
    # GPT-2's Conv1D stores weights as (in, out): transpose onto nn.Linear's (out, in).
    names = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for i in range(cfg.n_layers):
        for hf_name, ours in names.items():
            state[f"blocks.{i}.{ours}.weight"] = hf[f"h.{i}.{hf_name}.weight"].t().contiguous()
            state[f"blocks.{i}.{ours}.bias"] = hf[f"h.{i}.{hf_name}.bias"]
        for hf_name, ours in (("ln_1", "norm1"), ("ln_2", "norm2")):
            for p in ("weight", "bias"):
                state[f"blocks.{i}.{ours}.{p}"] = hf[f"h.{i}.{hf_name}.{p}"]
    return cfg, state, {"generation": GenerationDefaults(max_new_tokens=128)}


# --------------------------------------------------------------------------------------------------
def _marian(raw: dict[str, Any], hf: dict[str, Tensor], path: Path):
    cfg_file = path / "config.json"
    if not raw.get("share_encoder_decoder_embeddings", True) or raw.get("decoder_vocab_size", raw["vocab_size"]) != raw["vocab_size"]:
        raise CheckpointError(f"{cfg_file}: Marian models with separate source/target vocabularies are not supported")
    if raw["encoder_attention_heads"] != raw["decoder_attention_heads"] or raw["encoder_ffn_dim"] != raw["decoder_ffn_dim"]:
        raise CheckpointError(f"{cfg_file}: encoder and decoder must share head count and FFN width")
    if raw.get("normalize_before") or raw.get("add_final_layer_norm") or raw.get("normalize_embedding"):
        raise CheckpointError(f"{cfg_file}: pre-norm Marian variants are not supported")
    cfg = Seq2SeqConfig(
        vocab_size=raw["vocab_size"], d_model=raw["d_model"], n_heads=raw["encoder_attention_heads"],
        d_ff=raw["encoder_ffn_dim"], n_encoder_layers=raw["encoder_layers"], n_decoder_layers=raw["decoder_layers"],
        max_source_len=raw["max_position_embeddings"], max_target_len=raw["max_position_embeddings"],
        norm_placement="post", norm_eps=1e-5, activation=_act(raw.get("activation_function", "swish"), path),
        positions="sinusoidal", tie_embeddings=True, scale_embeddings=bool(raw.get("scale_embedding", False)),
        final_norm=False, final_logits_bias=True, decoder_start_token_id=raw["decoder_start_token_id"],
        eos_token_id=raw["eos_token_id"], pad_token_id=raw["pad_token_id"],
    )
    hf = _strip(hf, "model.")
    state = {"tok_emb.weight": hf.get("shared.weight", hf.get("encoder.embed_tokens.weight")),
             "final_logits_bias": hf["final_logits_bias"].reshape(-1)}
    if state["tok_emb.weight"] is None:
        raise CheckpointError(f"{path / 'model.safetensors'}: no shared embedding found")

    def attention(prefix: str, ours: str, fused: str) -> None:
        q, k, v = (hf[f"{prefix}.{n}_proj.weight"] for n in "qkv")
        qb, kb, vb = (hf[f"{prefix}.{n}_proj.bias"] for n in "qkv")
        if fused == "qkv":
            state[f"{ours}.qkv.weight"], state[f"{ours}.qkv.bias"] = torch.cat((q, k, v)), torch.cat((qb, kb, vb))
        else:
            state[f"{ours}.q.weight"], state[f"{ours}.q.bias"] = q, qb
            state[f"{ours}.kv.weight"], state[f"{ours}.kv.bias"] = torch.cat((k, v)), torch.cat((kb, vb))
        state[f"{ours}.proj.weight"], state[f"{ours}.proj.bias"] = hf[f"{prefix}.out_proj.weight"], hf[f"{prefix}.out_proj.bias"]

    def copy(src: str, dst: str) -> None:
        for p in ("weight", "bias"):
            state[f"{dst}.{p}"] = hf[f"{src}.{p}"]

    for side, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n):
            src, dst = f"{side}.layers.{i}", f"{side}.{i}"
            attention(f"{src}.self_attn", f"{dst}.attn", "qkv")
            copy(f"{src}.self_attn_layer_norm", f"{dst}.norm1")
            if side == "decoder":
                attention(f"{src}.encoder_attn", f"{dst}.cross_attn", "kv")
                copy(f"{src}.encoder_attn_layer_norm", f"{dst}.norm_cross")
            copy(f"{src}.fc1", f"{dst}.mlp.fc1")
            copy(f"{src}.fc2", f"{dst}.mlp.fc2")
            copy(f"{src}.final_layer_norm", f"{dst}.norm2")
    return cfg, state, {"generation": _generation_defaults(path, raw)}


# --------------------------------------------------------------------------------------------------
def _vit(raw: dict[str, Any], hf: dict[str, Tensor], path: Path):
    if not raw.get("qkv_bias", True):
        raise CheckpointError(f"{path / 'config.json'}: ViT without qkv bias is not supported")
    id2label = raw.get("id2label") or {}
    n_classes = len(id2label) or hf["classifier.weight"].shape[0]
    cfg = ViTConfig(
        d_model=raw["hidden_size"], n_heads=raw["num_attention_heads"], d_ff=raw["intermediate_size"],
        n_layers=raw["num_hidden_layers"], image_size=raw["image_size"], patch_size=raw["patch_size"],
        n_channels=raw.get("num_channels", 3), n_classes=n_classes, norm_eps=raw.get("layer_norm_eps", 1e-12),
        activation=_act(raw.get("hidden_act", "gelu"), path),
    )
    labels = [id2label.get(str(i), id2label.get(i, str(i))) for i in range(n_classes)]
    hf = {k: v for k, v in hf.items() if not k.startswith("vit.pooler.")}
    hf = _strip(hf, "vit.")
    state = {"cls_token": hf["embeddings.cls_token"], "pos_emb": hf["embeddings.position_embeddings"],
             "patch_embed.weight": hf["embeddings.patch_embeddings.projection.weight"],
             "patch_embed.bias": hf["embeddings.patch_embeddings.projection.bias"],
             "norm.weight": hf["layernorm.weight"], "norm.bias": hf["layernorm.bias"],
             "head.weight": hf["classifier.weight"], "head.bias": hf["classifier.bias"]}
    for i in range(cfg.n_layers):
        src, dst = f"encoder.layer.{i}", f"blocks.{i}"
        a = f"{src}.attention.attention"
        state[f"{dst}.attn.qkv.weight"] = torch.cat([hf[f"{a}.{n}.weight"] for n in ("query", "key", "value")])
        state[f"{dst}.attn.qkv.bias"] = torch.cat([hf[f"{a}.{n}.bias"] for n in ("query", "key", "value")])
        pairs = {f"{src}.attention.output.dense": f"{dst}.attn.proj", f"{src}.layernorm_before": f"{dst}.norm1",
                 f"{src}.layernorm_after": f"{dst}.norm2", f"{src}.intermediate.dense": f"{dst}.mlp.fc1",
                 f"{src}.output.dense": f"{dst}.mlp.fc2"}
        for s, d in pairs.items():
            state[f"{d}.weight"], state[f"{d}.bias"] = hf[f"{s}.weight"], hf[f"{s}.bias"]
    pre_file = path / "preprocessor_config.json"
    pre_cfg = json.loads(pre_file.read_text()) if pre_file.is_file() else {}
    preprocessing = ImagePreprocessing.from_hf(pre_cfg, cfg.image_size, cfg.n_channels)
    return cfg, state, {"labels": labels, "preprocessing": preprocessing}
