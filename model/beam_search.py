"""Beam search state for one request, with Hugging Face `generate(num_beams=...)` semantics.

The state is independent of how the model is run: each step the caller feeds next-token log-probs of the
request's `num_beams` rows and gets back, per new beam, the row it continues (its parent), so that the
caller can reorder its KV-cache rows. The same object serves the one-request loop in `generation.py` and
a continuous-batching scheduler that runs many requests' beams in one decoder batch.

Scoring (as in transformers' vectorised beam search): each step keeps the top 2 * num_beams candidates
over all beams x vocabulary by accumulated log-probability; candidates that end (eos or length limit)
among the top num_beams enter the finished set with score logp / generated_len ** length_penalty; the
best num_beams unfinished ones continue. Early stopping: `True` stops once num_beams hypotheses are
finished; `False` also stops when the best running beam, scored at its current length, cannot beat the
worst finished one; `"never"` scores it at the maximum length when length_penalty > 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_NEG = -1.0e9  # HF's "impossible" score; kept identical so that ties and orderings agree.


@dataclass
class BeamSettings:
    num_beams: int = 4
    max_new_tokens: int = 64
    eos_token_id: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    banned_token_ids: Sequence[int] = ()
    force_eos_at_max: bool = False  # Marian's forced_eos_token_id: the last possible token is eos


class BeamSearch:
    def __init__(self, settings: BeamSettings, start_token_id: int, device: torch.device | str = "cpu") -> None:
        if settings.num_beams < 1 or settings.max_new_tokens < 1:
            raise ValueError("num_beams and max_new_tokens must be >= 1")
        self.s = settings
        nb = settings.num_beams
        self.num_candidates = 2 * nb
        self.max_length = 1 + settings.max_new_tokens  # HF counts the decoder start token
        self.cur_len = 1
        self.running = torch.full((nb, self.max_length), start_token_id, dtype=torch.long, device=device)
        self.running_scores = torch.zeros(nb, device=device)
        self.running_scores[1:] = _NEG  # all beams start identical: only the first may expand
        self.finished = self.running.clone()
        self.finished_scores = torch.full((nb,), _NEG, device=device)
        self.finished_lengths = torch.zeros(nb, dtype=torch.long, device=device)
        self.is_finished = torch.zeros(nb, dtype=torch.bool, device=device)
        self.improvable = True
        self.done = False
        self._top_mask = torch.arange(self.num_candidates, device=device) < nb

    @property
    def step_index(self) -> int:
        """Position of the tokens in `last_tokens` (0 = the decoder start token)."""
        return self.cur_len - 1

    @property
    def last_tokens(self) -> Tensor:
        """(num_beams,) the token each running beam feeds to the decoder next."""
        return self.running[:, self.cur_len - 1]

    def advance(self, log_probs: Tensor) -> Tensor:
        """Take one step given log-probs (num_beams, V) of the running beams. Returns the parent row
        (num_beams,) of each new running beam."""
        s, nb = self.s, self.s.num_beams
        log_probs = log_probs.float().clone()
        if s.banned_token_ids:
            log_probs[:, list(s.banned_token_ids)] = float("-inf")
        if s.force_eos_at_max and self.cur_len == self.max_length - 1:
            log_probs = torch.full_like(log_probs, float("-inf"))
            log_probs[:, s.eos_token_id] = 0.0
        V = log_probs.size(-1)
        accumulated = (log_probs + self.running_scores[:, None]).view(-1)
        top_scores, top_idx = torch.topk(accumulated, k=self.num_candidates)
        beam, token = top_idx // V, top_idx % V
        cand = self.running[beam].clone()
        cand[:, self.cur_len] = token
        ends = (token == s.eos_token_id) | (self.cur_len + 1 >= self.max_length)

        # Running beams for the next step: the best candidates that did not end.
        running_scores = top_scores + ends.to(torch.float32) * _NEG
        keep = torch.topk(running_scores, k=nb)[1]
        parents = beam[keep]
        self.running, self.running_scores = cand[keep], running_scores[keep]

        # Finished hypotheses: merge candidates that just ended among the top num_beams.
        just_ended = ends & self._top_mask
        scores = top_scores / ((self.cur_len + 1 - 1) ** s.length_penalty)
        full = torch.all(self.is_finished) & (s.early_stopping is True)
        scores += full.to(torch.float32) * _NEG
        scores += float(not self.improvable) * _NEG
        scores += (~just_ended) * _NEG
        merged = torch.topk(torch.cat((self.finished_scores, scores)), k=nb)[1]
        lengths = torch.full_like(token, self.cur_len)
        self.finished = torch.cat((self.finished, cand))[merged]
        self.finished_scores = torch.cat((self.finished_scores, scores))[merged]
        self.finished_lengths = torch.cat((self.finished_lengths, lengths))[merged]
        self.is_finished = torch.cat((self.is_finished, just_ended))[merged]

        self.cur_len += 1
        self._update_improvable()
        all_full = bool(torch.all(self.is_finished)) and s.early_stopping is True
        self.done = not self.improvable or all_full or bool(torch.all(ends))
        return parents

    def _update_improvable(self) -> None:
        """Can the best running beam still beat the worst finished one? (HF's early-stop heuristic)"""
        s = self.s
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_len = self.max_length - 1
        else:
            best_len = self.cur_len - 1
        best_possible = self.running_scores[0] / (best_len**s.length_penalty)
        worst = torch.where(self.is_finished, self.finished_scores.min(), self.finished_scores.new_tensor(_NEG))
        self.improvable = self.improvable and bool(torch.any(best_possible > worst))

    def best(self) -> list[int]:
        """Generated ids of the best finished hypothesis (eos included when it ended on eos)."""
        n = int(self.finished_lengths[0])
        return self.finished[0, 1 : 1 + n].tolist()

    @property
    def best_score(self) -> float:
        return float(self.finished_scores[0])
