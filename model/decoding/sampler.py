"""Choosing the next token of every row at once, and the log-probabilities reported with it.

Sampling is the Gumbel-max trick in its exponential form: argmax(p / E) with E ~ Exp(1) per token draws
token i with probability p_i. Each sampled row's noise comes from its request's own generator, on the
model's device, so a seeded request draws the same tokens whatever else shares its batch, and the batch
needs one argmax and no copy of the probabilities to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from model.decoding.params import SamplingParams

# Noise of exactly 0 would divide a zero probability by zero; the smallest normal float changes nothing else.
_TINY = torch.finfo(torch.float32).tiny


def sample(scores: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> Tensor:
    """(rows,) next tokens: greedy rows take the argmax, sampled rows draw from softmax(scores), where the
    scores are already tempered and filtered by the pipeline."""
    tokens = scores.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    dev, V = scores.device, scores.size(-1)
    idx = torch.tensor(sampled, device=dev)
    probs = torch.softmax(scores[idx].float(), dim=-1)
    noise = torch.stack([torch.empty(V, device=dev).exponential_(generator=generators[i]) for i in sampled])
    return tokens.index_copy(0, idx, (probs / noise.clamp_min_(_TINY)).argmax(dim=-1))


def token_logprobs(logits: Tensor, tokens: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities of the chosen tokens (B,) and the top-n alternatives ((B, n) values, ids)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None])[:, 0]
    top_vals, top_ids = logp.topk(max(n, 1), dim=-1)
    return chosen, top_vals[:, :n], top_ids[:, :n]
