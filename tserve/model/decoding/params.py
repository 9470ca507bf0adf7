"""What a request asks of decoding: sampling parameters (OpenAI semantics) and their validation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """Per-request decoding parameters. temperature 0 = greedy."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report (0-5); None = no logprobs
    # What the output must match (model.decoding.structured.CompiledGrammar), compiled once per request.
    grammar: Any = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p removes anything (only then are the logits sorted)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The request's own random stream (None when greedy): a seeded request draws the same tokens
        whatever else shares its batch."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


def parse_logit_bias(bias: Mapping[str, float] | Mapping[int, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's `logit_bias` ({"token_id": bias}) checked against the vocabulary: ids in range, biases in
    [-100, 100], at most 300 entries. Raises ValueError with a message a client can act on."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias token id {token} is outside this model's vocabulary (0..{vocab_size - 1})")
        if not -MAX_LOGIT_BIAS <= float(value) <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias for token {token} is {value}; biases go from -100 to 100")
        out[token] = float(value)
    return out
