"""ViT (`ViTForImageClassification`): class token, learned positions, pre-norm blocks, linear head; labels
from id2label and image preprocessing from preprocessor_config.json."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tserve.model.config import ViTConfig
from tserve.model.importers.base import CheckpointError, WeightSource, read_json
from tserve.model.importers.common import activation
from tserve.model.preprocessing import ImagePreprocessing

MODEL_TYPES = ("vit",)


def config(raw: dict[str, Any], path: Path) -> ViTConfig:
    if not raw.get("qkv_bias", True):
        raise CheckpointError(f"{path / 'config.json'}: ViT without qkv bias is not supported")
    return ViTConfig(
        d_model=raw["hidden_size"], n_heads=raw["num_attention_heads"], d_ff=raw["intermediate_size"],
        n_layers=raw["num_hidden_layers"], image_size=raw["image_size"], patch_size=raw["patch_size"],
        n_channels=raw.get("num_channels", 3), n_classes=len(raw.get("id2label") or {}) or raw.get("num_labels", 2), norm_eps=raw.get("layer_norm_eps", 1e-12),
        activation=activation(raw, "hidden_act", "gelu", path),
    )


def extras(raw: dict[str, Any], path: Path, cfg: ViTConfig) -> dict[str, Any]:
    id2label = raw.get("id2label") or {}
    labels = [id2label.get(str(i), id2label.get(i, str(i))) for i in range(cfg.n_classes)]
    pre_cfg = read_json(path / "preprocessor_config.json", required=False) or {}
    processor = "DeiTImageProcessor" if raw.get("model_type") == "deit" else "ViTImageProcessor"
    return {"labels": labels,
            "preprocessing": ImagePreprocessing.from_hf(pre_cfg, cfg.image_size, cfg.n_channels, processor)}


def weights(cfg: ViTConfig, hf: WeightSource, heads: dict[str, str] | None = None) -> Iterator[tuple[str, Tensor]]:
    """`heads`: our classifier head(s) by the checkpoint's name for each (ViT's: `classifier`)."""
    hf.strip_prefix("vit.")
    yield "cls_token", hf["embeddings.cls_token"]
    yield "pos_emb", hf["embeddings.position_embeddings"]
    yield "patch_embed.weight", hf["embeddings.patch_embeddings.projection.weight"]
    yield "patch_embed.bias", hf["embeddings.patch_embeddings.projection.bias"]
    for ours, theirs in (("norm", "layernorm"), *(heads or {"head": "classifier"}).items()):
        yield f"{ours}.weight", hf[f"{theirs}.weight"]
        yield f"{ours}.bias", hf[f"{theirs}.bias"]
    for i in range(cfg.n_layers):
        theirs, ours = f"encoder.layer.{i}", f"blocks.{i}"
        a = f"{theirs}.attention.attention"
        for p in ("weight", "bias"):
            yield f"{ours}.attn.qkv.{p}", torch.cat([hf[f"{a}.{n}.{p}"] for n in ("query", "key", "value")])
        pairs = {f"{theirs}.attention.output.dense": f"{ours}.attn.proj", f"{theirs}.layernorm_before": f"{ours}.norm1",
                 f"{theirs}.layernorm_after": f"{ours}.norm2", f"{theirs}.intermediate.dense": f"{ours}.mlp.fc1",
                 f"{theirs}.output.dense": f"{ours}.mlp.fc2"}
        for t, o in pairs.items():
            yield f"{o}.weight", hf[f"{t}.weight"]
            yield f"{o}.bias", hf[f"{t}.bias"]
