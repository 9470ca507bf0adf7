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

from tserve.model.decoding.params import SamplingParams
from tserve.model.decoding.top_tokens import log_probs_at, top_tokens
from tserve.model.device_inputs import to_device
from tserve.model.kernels.cpu import argmax

# Noise of exactly 0 would divide a zero probability by zero; the smallest normal float changes nothing else.
_TINY = torch.finfo(torch.float32).tiny


def sample(scores: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> Tensor:
    """(rows,) next tokens: greedy rows take the argmax, sampled rows draw from softmax(scores), where the
    scores are already tempered and filtered by the pipeline."""
    tokens = argmax(scores)  # the lowest column on ties; our kernel on a CPU, where PyTorch's takes ~20x longer
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    dev = scores.device
    idx = to_device(sampled, dev)
    probs = torch.softmax(scores[idx].float(), dim=-1)
    noise = torch.stack([exponential_noise(probs.size(-1), generators[i]) for i in sampled])
    return tokens.index_copy(0, idx, (probs / noise).argmax(dim=-1))


def draw(probs: Tensor, generator: torch.Generator) -> int:
    """One token from one row's probabilities (V,), as `sample` draws it for that row."""
    return int((probs / exponential_noise(probs.size(-1), generator)).argmax())


def exponential_noise(vocab_size: int, generator: torch.Generator) -> Tensor:
    """A row's next noise vector from its generator (on the generator's device)."""
    return torch.empty(vocab_size, device=generator.device).exponential_(generator=generator).clamp_min_(_TINY)


def token_logprobs(logits: Tensor, tokens: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities of the chosen tokens (B,) and the top-n alternatives ((B, n) values, ids), with no
    (B, V) log-softmax written."""
    logits = logits.float()
    if n == 0:  # the chosen tokens' alone (`logprobs: 0`): no search for alternatives
        at = log_probs_at(logits, tokens[:, None])
        return at[:, 0], at[:, 1:], tokens.new_empty(tokens.size(0), 0)
    top_ids = top_tokens(logits, n, log_probs=False)[1]
    at = log_probs_at(logits, torch.cat((tokens[:, None], top_ids), 1))  # one log-softmax pass for both
    return at[:, 0], at[:, 1:], top_ids
