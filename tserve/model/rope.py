"""Rotary position tables, with the context-extension schemes Llama-family checkpoints use.

`tables` returns cos/sin of every (position, frequency) pair, (max_len, d_head / 2) each, which
`model.attention.Rotary` gathers at the positions of a forward. The frequencies follow Hugging Face
`transformers` (`modeling_rope_utils`) exactly, so that imported checkpoints match it:

- default: inv_freq[i] = 1 / base ** (2i / d)
- `linear`: every frequency divided by `factor`
- `llama3`: low frequencies (wavelength > original context / low_freq_factor) divided by `factor`, high
  ones kept, the band between blended smoothly
- `dynamic` (NTK-aware): within `max_position_embeddings` the default; beyond it, a position p is rotated
  with the base transformers uses for a sequence of p + 1 tokens. That equals transformers' own tables while
  decoding token by token; a prompt longer than the original context in a single forward is rotated by
  transformers with one base for all its positions (its result depends on how a prompt is chunked), and
  here position by position.
- `longrope` (Phi-3, Phi-4-mini; "su" in early configs): each frequency divided by its own factor, the
  `short_factor` list within `original_max_position_embeddings` and the `long_factor` list beyond it, and cos/sin
  multiplied by an attention factor (sqrt(1 + ln(factor) / ln(original context)), factor = context / original
  context, unless the config gives it). transformers switches a whole forward to the long factors once its last
  position passes the original context: equal to these tables while its model decodes token by token with its
  cache, and for any prompt within the original context; a longer prompt in one forward is rotated here position
  by position. (Phi-3's `generate` in transformers also discards its cache once, when the text first passes the
  original context, and recomputes every position with the long factors; here the positions already cached keep
  the short ones, as vLLM's do.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

SCALINGS = ("default", "linear", "llama3", "dynamic", "longrope")
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings")}
_ALIASES = {"su": "longrope"}


def scaling_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return _ALIASES.get(kind, kind)


def check_scaling(scaling: dict[str, Any]) -> None:
    """ValueError naming the field when a scaling is not one we implement or lacks a parameter."""
    kind = scaling_type(scaling)
    if kind not in SCALINGS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SCALINGS)})")
    missing = [k for k in _REQUIRED.get(kind, ()) if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs {missing}")
    if kind == "dynamic" and not scaling.get("max_position_embeddings"):
        raise ValueError("rope_scaling of type 'dynamic' needs max_position_embeddings (the trained context)")
    if kind == "longrope" and len(scaling["short_factor"]) != len(scaling["long_factor"]):
        raise ValueError("rope_scaling of type 'longrope': short_factor and long_factor differ in length")


def inv_freq(d_head: int, base: float) -> Tensor:
    return 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head))


def _llama3(freqs: Tensor, s: dict[str, Any]) -> Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context = float(s["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def tables(d_head: int, max_len: int, base: float = 10000.0,
           scaling: dict[str, Any] | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin, (max_len, d_head / 2) each, float32."""
    kind = scaling_type(scaling)
    positions = torch.arange(max_len, dtype=torch.float32)
    if kind == "dynamic":
        trained, factor = int(scaling["max_position_embeddings"]), float(scaling["factor"])
        angles = positions[:, None] * inv_freq(d_head, base)[None, :]
        if max_len > trained:  # each later position with the base of a (p + 1)-token sequence
            later = torch.arange(trained, max_len, dtype=torch.float64)
            bases = base * (factor * (later + 1) / trained - (factor - 1)) ** (d_head / (d_head - 2))
            exponents = torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head
            freqs = 1.0 / (bases.float()[:, None] ** exponents[None, :])
            angles[trained:] = positions[trained:, None] * freqs
        return angles.cos(), angles.sin()
    if kind == "longrope":
        return _longrope(d_head, max_len, base, scaling)
    freqs = inv_freq(d_head, base)
    if kind == "linear":
        freqs = freqs / float(scaling["factor"])
    elif kind == "llama3":
        freqs = _llama3(freqs, scaling)
    angles = positions[:, None] * freqs[None, :]
    return angles.cos(), angles.sin()


def _longrope(d_head: int, max_len: int, base: float, s: dict[str, Any]) -> tuple[Tensor, Tensor]:
    original, factor = int(s["original_max_position_embeddings"]), float(s["factor"])
    for name in ("short_factor", "long_factor"):
        if len(s[name]) != d_head // 2:
            raise ValueError(f"rope_scaling of type 'longrope': {name} has {len(s[name])} factors for "
                             f"{d_head // 2} frequencies")
    attention = s.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    exponents = torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head
    short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * base**exponents)
    long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * base**exponents)
    positions = torch.arange(max_len, dtype=torch.float32)[:, None]
    angles = torch.where(positions < original, positions * short[None, :], positions * long[None, :])
    return angles.cos() * attention, angles.sin() * attention
