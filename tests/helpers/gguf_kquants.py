"""K-quant blocks (Q4_K, Q5_K, Q6_K) for the tests' GGUF files, which the `gguf` library reads but cannot write:
laid out as its dequantizers (gguf-py's quants.py) read them, each row in super-blocks of 256 weights. The
codes are plain rounding against each sub-block's scale (llama.cpp's quantizer searches for better scales; the
layout, which is what a reader must get right, is the same); and a Llama-layout fixture widened to rows of 256
(`widened_llama`), the same model, for K-quant files of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

QK_K = 256
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> Q4_K / Q5_K's 12 bytes (the inverse of quants.Q4_K.get_scale_min)."""
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    m_d = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, m_d], axis=1).astype(np.uint8)


def _affine(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """(n, 256) -> d, dmin (n,) float16-rounded, 6-bit sc and mn (n, 8), codes q (n, 8, 32) in 0..levels:
    x ≈ d * sc * q - dmin * mn per sub-block of 32."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)
    scale = (sub.max(axis=-1) - low) / levels
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.round((sub + (dmin[:, None] * mn)[..., None]) / np.where(step == 0, 1, step))
    return d, dmin, sc, mn, np.clip(q, 0, levels).astype(np.uint8)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(blocks, 15)
    qs = q.reshape(-1, 4, 2, 32)  # the pairs of sub-blocks share bytes: low nibble the first, high the second
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scale_bytes(sc, mn), qs], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(blocks, 31)
    low, high = q & 0x0F, q >> 4  # (n, 8, 32)
    qh = np.zeros((len(q), 32), dtype=np.uint8)
    for s in range(8):  # bit s of byte j: the fifth bit of weight j of sub-block s
        qh |= high[:, s] << s
    qs = low.reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scale_bytes(sc, mn), qh, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    u = (np.clip(np.round(sub / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 2, 2, 32)
    low, high = u & 0x0F, u >> 4  # position h * 128 + s * 64 + j: (h, s, j) with j over 64 = (two halves of 32)
    low = low.reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = high.reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize_k(weights: np.ndarray, kind: str) -> np.ndarray:
    """A float32 (rows, K) array, K a multiple of 256, as `kind`'s blocks: uint8 (rows, K / 256 * block bytes)."""
    rows, k = weights.shape
    assert k % QK_K == 0, f"{kind} needs rows of whole super-blocks of {QK_K}, got {k}"
    return _QUANTIZERS[kind](weights.astype(np.float32).reshape(-1, QK_K)).reshape(rows, -1)


def widened_llama(d: Path, out: Path, width: int = QK_K) -> Path:
    """The Llama-layout checkpoint `d` with its hidden and MLP widths padded with zeros to `width`, the same model
    (logits equal): rows of whole K-quant super-blocks for every layer but the attention output (its inputs are the
    heads'). The residual stream's new features stay zero; RMSNorm's mean over 4x the features is a quarter, so
    the norms' weights are halved and eps quartered (for `width` 4x the hidden size)."""
    cfg = json.loads((d / "config.json").read_text())
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    ratio = width / hidden
    shutil.copytree(d, out, dirs_exist_ok=True)
    tensors = {}
    for name, t in load_file(str(d / "model.safetensors")).items():
        if name.endswith("norm.weight"):
            t = np.pad(t / np.sqrt(ratio).astype(t.dtype), (0, width - hidden))
        elif name.endswith(("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight",
                            "v_proj.weight")):
            t = np.pad(t, ((0, 0), (0, width - hidden)))
        elif name.endswith("o_proj.weight"):
            t = np.pad(t, ((0, width - hidden), (0, 0)))
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            t = np.pad(t, ((0, width - ffn), (0, width - hidden)))
        elif name.endswith("down_proj.weight"):
            t = np.pad(t, ((0, width - hidden), (0, width - ffn)))
        tensors[name] = np.ascontiguousarray(t)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg |= {"hidden_size": width, "intermediate_size": width, "rms_norm_eps": cfg["rms_norm_eps"] / ratio,
            "head_dim": cfg.get("head_dim") or hidden // cfg["num_attention_heads"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
