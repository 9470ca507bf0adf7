"""Speculative decoding with prompt-lookup drafts: a running sequence guesses its next few tokens from its own
context (the tokens that followed the latest earlier occurrence of its last n tokens: code, quotes, names and
lists repeat), and one forward pass scores its next token and the whole guess. The longest prefix of the guess
that the model itself would have chosen is kept, plus one token of the model's own, so a step yields 1 to k+1
tokens for one read of the weights — on a CPU, where a decode step is the time it takes to read them, that
is the speed-up.

Acceptance keeps the output the model's:
- greedy rows keep draft token j while it is the argmax at position j (the output equals non-speculative
  greedy decoding);
- sampled rows draw the token of position j as they would without speculation (the same draw from their own
  generator) and keep the draft while the draws agree with it. For a point-mass draft (q = 1 on the guessed
  token) this is exactly speculative sampling's rule (Leviathan et al. 2023: keep d with probability p(d), else
  draw from p without d), and it uses the generator as plain decoding does, so a seeded request's tokens are
  the same with speculation or without, alone or beside others.
A draft is made only where the scores of position j depend on nothing but j (no grammar, no penalties), and
a request whose drafts are mostly rejected pauses drafting for a while (`Speculation.judge`): text that
stopped repeating costs nothing more than the lookups, and text that starts repeating again is drafted for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tserve.model.decoding.logits import LogitsPipeline
from tserve.model.decoding.sampler import draw
from tserve.model.kernels.cpu import argmax

JUDGED_EVERY = 8  # draft tokens a request proposes between two judgements of its acceptance
PAUSE_TOKENS = 16  # tokens a request generates without drafting after a judgement found its drafts rejected


@dataclass(frozen=True)
class Speculation:
    """Prompt-lookup settings: up to `num_tokens` draft tokens, from the longest suffix of `max_ngram` down to
    `min_ngram` tokens found earlier in the sequence; only while at most `max_rows` sequences run (a step
    feeds each row its draft's length: on a CPU, more rows than a few make the step compute-bound, and the
    draft's extra rows cost more than they save). A request whose acceptance over its last `JUDGED_EVERY`
    draft tokens is below `min_acceptance` drafts nothing for its next `PAUSE_TOKENS` tokens."""

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    min_acceptance: float = 0.3
    max_rows: int = 4

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram or self.max_rows < 1:
            raise ValueError("speculation needs num_tokens >= 1, 1 <= min_ngram <= max_ngram and max_rows >= 1")

    def drafting(self, seq: object) -> bool:
        """Whether `seq` drafts at this step: judge its recent acceptance first (pausing it when low)."""
        if seq.recent_drafted >= JUDGED_EVERY:
            if seq.recent_accepted < self.min_acceptance * seq.recent_drafted:
                seq.resume_at = seq.num_generated + PAUSE_TOKENS
            seq.recent_drafted = seq.recent_accepted = 0
        return seq.num_generated >= seq.resume_at and drafts_allowed(seq)


class NgramIndex:
    """Where each n-gram of a sequence last ended, kept up to date as the sequence grows (amortised O(1) a
    token), so a draft is a dictionary lookup however long the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(min_n, max_n + 1)
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._indexed = 0  # n-grams ending at positions <= this are in `_ends`

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found; [] if none."""
        last = len(tokens)
        for end in range(self._indexed + 1, last):  # every n-gram ending before the current suffix's end
            for n in self.sizes:
                if end >= n:
                    self._ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, last - 1)
        for n in reversed(self.sizes):
            if last >= n and (end := self._ends.get(tuple(tokens[last - n:]))) is not None:
                return list(tokens[end:end + k])
        return []


class _Ahead:
    """A sequence as the logits pipeline sees it j tokens further on (for the scores of draft position j)."""

    def __init__(self, seq: object, j: int) -> None:
        self.params, self.num_generated = seq.params, seq.num_generated + j
        self.token_mask = None

    def token_counts(self, vocab_size: int, device: torch.device) -> Tensor:
        raise AssertionError("penalized rows are never drafted for")


def drafts_allowed(seq: object) -> bool:
    """Whether the scores at a draft position depend only on the position: no grammar, no penalties."""
    return seq.grammar is None and not seq.params.penalized


def accept(pipeline: LogitsPipeline, seqs: Sequence[object], drafts: Sequence[list[int]], logits: Tensor,
           ) -> tuple[list[list[int]], Tensor, Tensor, list[list[int]]]:
    """The tokens each sequence keeps from one speculative step: its accepted draft tokens, then one token of
    the model's (a correction or a bonus). `logits` (B, T, V): position j of row i scores the token after
    its j-th fed token (its next token, then its draft). Returns the tokens per row, the constrained scores of
    every scored position (N, V) with the chosen token of each (N,), and per row the indices into those of
    the positions its tokens came from (for logprobs)."""
    rows, flat_index = [], []
    for i, (s, d) in enumerate(zip(seqs, drafts, strict=True)):
        for j in range(len(d) + 1):
            rows.append(s if j == 0 else _Ahead(s, j))
            flat_index.append(i * logits.size(1) + j)
    dev = logits.device
    scores = logits.reshape(-1, logits.size(-1)).index_select(0, torch.tensor(flat_index, device=dev))
    constrained = pipeline.constrain(scores, rows)
    shaped = pipeline.shape(constrained, rows)
    greedy_choice = argmax(shaped).tolist()
    out: list[list[int]] = []
    chosen = list(greedy_choice)
    positions: list[list[int]] = []
    start = 0
    sampled_probs = None
    if any(not s.params.greedy for s in seqs):
        sampled_probs = torch.softmax(shaped.float(), dim=-1)
    for s, d in zip(seqs, drafts, strict=True):
        n = len(d) + 1
        if s.params.greedy:
            kept = 0
            while kept < len(d) and greedy_choice[start + kept] == d[kept]:
                kept += 1
            tokens = d[:kept] + [greedy_choice[start + kept]]
        else:
            tokens = _sample_ahead(sampled_probs[start:start + n], d, s.generator)
        for j, t in enumerate(tokens):
            chosen[start + j] = t
        out.append(tokens)
        positions.append(list(range(start, start + len(tokens))))
        start += n
    return out, constrained, torch.tensor(chosen, device=dev), positions


def _sample_ahead(probs: Tensor, draft: list[int], generator: torch.Generator) -> list[int]:
    """A sampled row's tokens: at each position the token it would draw without speculation (the same draw from
    its generator: one exponential noise vector per token), the draft kept while the draws agree with it. With a
    point-mass draft this is exactly rejection sampling (d kept with probability p(d), else a draw from p without
    d), and it consumes the generator as plain decoding does: a seeded request's tokens are the same with or
    without speculation, whatever else runs."""
    tokens = []
    for j in range(len(draft) + 1):
        tokens.append(draw(probs[j], generator))
        if j == len(draft) or tokens[-1] != draft[j]:
            return tokens
    return tokens
