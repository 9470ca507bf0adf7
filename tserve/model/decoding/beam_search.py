"""Beam search state for one request, with Hugging Face `generate(num_beams=...)` semantics.

The state is independent of how the model is run: each step the caller feeds next-token log-probs of the
request's `num_beams` rows, already through the constraints of the logits pipeline (banned ids, forced
eos), whole (`advance_many`) or as each row's few best tokens (`advance_top`), and gets back, per new
beam, the row it continues (its parent), so that the caller can reorder its KV-cache rows. `Seq2SeqRunner`
runs many requests' beams in one decoder batch.

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


class BeamSearch:
    """One request's beams. `advance` takes one step; `advance_many` takes one step for several requests with
    the same beam settings (apart from max_new_tokens) in one set of tensor operations, which is what keeps a
    GPU busy when many beam requests run together. Both give each request exactly the result it gets alone.

    `width` (optional) sizes the hypothesis buffers, so that requests with different `max_new_tokens` can
    be stacked; positions past a hypothesis' length are never read.
    """

    reads_whole_distribution = False  # a step reads each beam's few best tokens only (`advance_top`)

    def __init__(self, settings: BeamSettings, start_token_id: int, device: torch.device | str = "cpu",
                 width: int | None = None) -> None:
        if settings.num_beams < 1 or settings.max_new_tokens < 1:
            raise ValueError("num_beams and max_new_tokens must be >= 1")
        self.s = settings
        nb = settings.num_beams
        self.max_length = 1 + settings.max_new_tokens  # HF counts the decoder start token
        self.cur_len = 1
        width = max(width or 0, self.max_length)
        self.running = torch.full((nb, width), start_token_id, dtype=torch.long, device=device)
        self.running_scores = torch.zeros(nb, device=device)
        self.running_scores[1:] = _NEG  # all beams start identical: only the first may expand
        self.finished = self.running.clone()
        self.finished_scores = torch.full((nb,), _NEG, device=device)
        self.finished_lengths = torch.zeros(nb, dtype=torch.long, device=device)
        self.is_finished = torch.zeros(nb, dtype=torch.bool, device=device)
        self.improvable = torch.ones((), dtype=torch.bool, device=device)
        self.done = False

    @property
    def step_index(self) -> int:
        """Position of the tokens in `last_tokens` (0 = the decoder start token)."""
        return self.cur_len - 1

    @property
    def last_tokens(self) -> Tensor:
        """(num_beams,) the token each running beam feeds to the decoder next."""
        return self.running[:, self.cur_len - 1]

    def tokens_at(self, position: int) -> Tensor:
        """(num_beams,) the token each running beam fed to the decoder at `position` (to recompute its cache)."""
        return self.running[:, position]

    def group_key(self) -> tuple:
        """Requests with equal keys can advance together."""
        s = self.s
        return (s.num_beams, s.eos_token_id, s.length_penalty, s.early_stopping, self.running.size(1),
                self.running.device)

    def advance(self, log_probs: Tensor) -> Tensor:
        """Take one step given log-probs (num_beams, V) of the running beams. Returns the parent row
        (num_beams,) of each new running beam."""
        return BeamSearch.advance_many([self], log_probs)[0]

    def tokens_per_beam(self, vocab_size: int) -> int:
        """How many of each beam's best tokens a step reads (`advance_top`)."""
        return min(2 * self.s.num_beams, vocab_size)

    @staticmethod
    def advance_many(searches: Sequence[BeamSearch], log_probs: Tensor) -> Tensor:
        """One step for R requests of one `group_key`: log_probs (R * num_beams, V), the requests' rows in
        order. Returns parents (R, num_beams); each search's state and `done` are updated (one host sync)."""
        k = searches[0].tokens_per_beam(log_probs.size(-1))
        return BeamSearch.advance_top(searches, *torch.topk(log_probs.float(), k=k, dim=-1))

    @staticmethod
    def advance_top(searches: Sequence[BeamSearch], row_scores: Tensor, row_tokens: Tensor) -> Tensor:
        """`advance_many` given each row's `tokens_per_beam` best tokens (R * num_beams, k), best first, and
        their log-probs: the 2 * nb best of nb * V candidates (beam score + token log-prob) are among each
        beam's own 2 * nb best tokens, so choosing from those nb * 2 * nb gives the same candidates as the full
        sum and top-k, which with a 256k vocabulary cost more than the rest of the step."""
        first = searches[0]
        s, nb, R = first.s, first.s.num_beams, len(searches)
        device = row_scores.device
        k = row_scores.size(-1)
        row_scores, row_tokens = row_scores.float().view(R, nb, k), row_tokens.view(R, nb, k)
        cur_len = torch.tensor([x.cur_len for x in searches], device=device)
        max_length = torch.tensor([x.max_length for x in searches], device=device)
        running = torch.stack([x.running for x in searches])  # (R, nb, W)
        running_scores = torch.stack([x.running_scores for x in searches])
        W = running.size(-1)

        top_scores, pick = torch.topk((row_scores + running_scores[:, :, None]).view(R, nb * k), k=2 * nb, dim=1)
        beam, token = pick // k, row_tokens.view(R, nb * k).gather(1, pick)
        cand = running.gather(1, beam[:, :, None].expand(R, 2 * nb, W))
        cand.scatter_(2, cur_len[:, None, None].expand(R, 2 * nb, 1), token[:, :, None])
        ends = (token == s.eos_token_id) | (cur_len + 1 >= max_length)[:, None]

        # Running beams for the next step: the best candidates that did not end.
        next_scores = top_scores + ends.to(torch.float32) * _NEG
        keep = torch.topk(next_scores, k=nb, dim=1)[1]
        parents = beam.gather(1, keep)
        running = cand.gather(1, keep[:, :, None].expand(R, nb, W))
        running_scores = next_scores.gather(1, keep)

        # Finished hypotheses: merge candidates that just ended among the top num_beams.
        is_finished = torch.stack([x.is_finished for x in searches])
        finished_scores = torch.stack([x.finished_scores for x in searches])
        improvable = torch.stack([x.improvable for x in searches])
        just_ended = ends & (torch.arange(2 * nb, device=device) < nb)
        # Length penalties computed on the host in double precision, as transformers does, then float32.
        pen = lambda n: float(n) ** s.length_penalty  # noqa: E731
        scores = top_scores / torch.tensor([pen(x.cur_len) for x in searches], device=device)[:, None]
        if s.early_stopping is True:
            scores = scores + torch.all(is_finished, dim=1, keepdim=True).to(torch.float32) * _NEG
        scores = scores + (~improvable)[:, None].to(torch.float32) * _NEG
        scores = scores + (~just_ended).to(torch.float32) * _NEG
        all_scores = torch.cat((finished_scores, scores), 1)
        merged = torch.topk(all_scores, k=nb, dim=1)[1]
        finished = torch.cat((torch.stack([x.finished for x in searches]), cand), 1)
        finished = finished.gather(1, merged[:, :, None].expand(R, nb, W))
        finished_scores = all_scores.gather(1, merged)
        lengths = torch.cat((torch.stack([x.finished_lengths for x in searches]),
                             cur_len[:, None].expand(R, 2 * nb)), 1)
        finished_lengths = lengths.gather(1, merged)
        is_finished = torch.cat((is_finished, just_ended), 1).gather(1, merged)

        # Can the best running beam still beat the worst finished one? (HF's early-stop heuristic)
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_len = [x.max_length - 1 for x in searches]
        else:
            best_len = [x.cur_len for x in searches]  # the new length minus the start token
        best_possible = running_scores[:, 0] / torch.tensor([pen(n) for n in best_len], device=device)
        worst = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True)[0],
                            torch.full_like(finished_scores, _NEG))
        improvable = improvable & torch.any(best_possible[:, None] > worst, dim=1)
        done = ~improvable | torch.all(ends, dim=1)
        if s.early_stopping is True:
            done |= torch.all(is_finished, dim=1)

        for i, (x, d) in enumerate(zip(searches, done.tolist(), strict=True)):  # the one host sync
            x.running, x.running_scores = running[i], running_scores[i]
            x.finished, x.finished_scores = finished[i], finished_scores[i]
            x.finished_lengths, x.is_finished = finished_lengths[i], is_finished[i]
            x.improvable, x.cur_len, x.done = improvable[i], x.cur_len + 1, d
        return parents

    def best(self) -> list[int]:
        """Generated ids of the best finished hypothesis (eos included when it ended on eos)."""
        n = int(self.finished_lengths[0])
        return self.finished[0, 1 : 1 + n].tolist()

    def hypotheses(self, n: int) -> list[tuple[list[int], float]]:
        """Up to `n` finished hypotheses, best first: (generated ids, eos included when reached; score)."""
        lengths, scores = self.finished_lengths.tolist(), self.finished_scores.tolist()
        done = self.is_finished.tolist()
        return [(self.finished[i, 1 : 1 + lengths[i]].tolist(), scores[i])
                for i in range(min(n, len(done))) if done[i] or i == 0]

    @property
    def best_score(self) -> float:
        return float(self.finished_scores[0])
