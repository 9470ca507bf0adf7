"""Beam search with hard lexical constraints: every hypothesis that finishes contains each constraint (a
token sequence, e.g. a glossary term) somewhere in its output. Dynamic beam allocation (Post & Vilar 2018):

- each step, candidates come from every beam's best tokens, plus, for every beam, the next token of each
  constraint it could advance (the next token of the one it is in the middle of, or the first token of each
  it has not met), so that constraints are tried even where the model would not choose them;
- a candidate's bank is the number of constraint tokens it has met; the beam is split between the banks,
  best first within each, and slots a bank cannot fill go to the best remaining candidates, so hypotheses
  that met fewer constraints are not crowded out by (or crowd out) those that met more; with more banks than
  beams, the most advanced bank and then the best-scored ones (`_allocate`);
- a constraint started and then left unfinished counts for nothing again;
- eos is allowed only to a hypothesis that has met every constraint, and only such hypotheses finish.

Scores are those of `BeamSearch` (log-probability over generated length ** length_penalty), so teacher
forcing a result gives its score. One request at a time (the bookkeeping is on the host, a few dozen
candidates per step); its rows still share the decoder batch with everything else that runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tserve.model.decoding.beam_search import BeamSettings

_NEG = -1.0e9


class ConstraintsUnmet(ValueError):
    """Glossary terms that cannot be placed: no hypothesis placed every constraint within the length limit,
    or `why` says what else kept them out (a 422 naming them)."""

    def __init__(self, terms: Sequence[str], why: str = "could not be placed within max_tokens") -> None:
        super().__init__(f"these glossary terms {why}: " + ", ".join(repr(t) for t in terms))
        self.terms = list(terms)


@dataclass(frozen=True)
class _Beam:
    tokens: tuple[int, ...]
    score: float  # accumulated log-probability
    met: frozenset[int]  # constraints placed whole
    partial: tuple[int, int] | None  # (constraint, tokens of it placed so far) while in the middle of one


class ConstrainedBeamSearch:
    """Same interface as `BeamSearch` for one request with `constraints` (token id lists, none empty)."""

    reads_whole_distribution = True  # a constraint's next token is tried whatever its rank

    def __init__(self, settings: BeamSettings, start_token_id: int, constraints: Sequence[Sequence[int]],
                 terms: Sequence[str] | None = None, device: torch.device | str = "cpu") -> None:
        if not constraints or any(not c for c in constraints):
            raise ValueError("constraints must be non-empty token lists")
        self.s, self.device = settings, torch.device(device)
        self.constraints = [list(c) for c in constraints]
        self.terms = list(terms) if terms is not None else [str(c) for c in self.constraints]
        self.max_length = 1 + settings.max_new_tokens
        self.cur_len = 1
        self.start = start_token_id
        first = _Beam((), 0.0, frozenset(), None)
        self.beams = [first] + [_Beam((), _NEG, frozenset(), None)] * (settings.num_beams - 1)
        self.finished: list[tuple[float, tuple[int, ...]]] = []  # (normalised score, tokens), best first
        self.done = False

    # The runner's view -------------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        return self.cur_len - 1

    @property
    def last_tokens(self) -> Tensor:
        return torch.tensor([b.tokens[-1] if b.tokens else self.start for b in self.beams], device=self.device)

    def tokens_at(self, position: int) -> Tensor:
        return torch.tensor([b.tokens[position - 1] if 0 < position <= len(b.tokens) else self.start
                             for b in self.beams], device=self.device)

    def group_key(self) -> tuple:
        return ("constrained", id(self))  # advances alone

    @staticmethod
    def advance_many(searches: Sequence[ConstrainedBeamSearch], log_probs: Tensor) -> Tensor:
        (search,) = searches
        return search.advance(log_probs)[None]

    def hypotheses(self, n: int) -> list[tuple[list[int], float]]:
        return [(list(tokens), score) for score, tokens in self.finished[:n]]

    def best(self) -> list[int]:
        if not self.finished:
            raise ConstraintsUnmet(self.unmet_terms())
        return list(self.finished[0][1])

    def unmet_terms(self) -> list[str]:
        """The terms the most advanced running hypothesis has not placed."""
        met = max((b.met for b in self.beams), key=len, default=frozenset())
        return [t for j, t in enumerate(self.terms) if j not in met]

    # One step ------------------------------------------------------------------------------------------
    def _placed(self, beam: _Beam) -> int:
        return sum(len(self.constraints[j]) for j in beam.met) + (beam.partial[1] if beam.partial else 0)

    def _step(self, beam: _Beam, token: int, logp: float) -> _Beam:
        met, partial = beam.met, beam.partial
        if partial is not None:
            j, k = partial
            if self.constraints[j][k] == token:
                partial = (j, k + 1)
            else:
                partial = None  # left unfinished: counts for nothing
        if partial is None:
            for j, c in enumerate(self.constraints):
                if j not in met and c[0] == token:
                    partial = (j, 1)
                    break
        if partial is not None and partial[1] == len(self.constraints[partial[0]]):
            met, partial = met | {partial[0]}, None
        return _Beam(beam.tokens + (token,), beam.score + logp, met, partial)

    def advance(self, log_probs: Tensor) -> Tensor:
        """log_probs (num_beams, V) of the running beams; returns each new beam's parent (num_beams,)."""
        s, nb = self.s, self.s.num_beams
        eos, n_constraints = s.eos_token_id, len(self.constraints)
        lp = log_probs.float().clone()
        for b, beam in enumerate(self.beams):
            if len(beam.met) < n_constraints:
                lp[b, eos] = _NEG  # not done until every constraint is placed
        top_v, top_i = torch.topk(lp, k=min(nb, lp.size(1)), dim=1)
        wanted = {}
        for b, beam in enumerate(self.beams):
            if beam.score <= _NEG / 2:
                continue
            if beam.partial is not None:
                j, k = beam.partial
                wanted[(b, self.constraints[j][k])] = None
            for j, c in enumerate(self.constraints):
                if j not in beam.met:
                    wanted[(b, c[0])] = None
        forced = list(wanted)
        forced_lp = lp[[b for b, _ in forced], [t for _, t in forced]].tolist() if forced else []
        pairs = {(b, t): v for b, (vs, ts) in enumerate(zip(top_v.tolist(), top_i.tolist(), strict=True))
                 for v, t in zip(vs, ts, strict=True)}
        pairs.update({bt: v for bt, v in zip(forced, forced_lp, strict=True)})

        last_step = self.cur_len + 1 >= self.max_length
        candidates: list[tuple[_Beam, int]] = []
        for (b, token), logp in pairs.items():
            beam = self.beams[b]
            if beam.score <= _NEG / 2 or logp <= _NEG / 2:
                continue
            new = self._step(beam, token, logp)
            if token == eos or last_step:
                if len(new.met) == n_constraints:
                    self._finish(new)
                continue
            candidates.append((new, b))
        self.cur_len += 1
        chosen = self._allocate(candidates, nb)
        self.beams = [c for c, _ in chosen]
        parents = [p for _, p in chosen]
        while len(self.beams) < nb:  # fewer candidates than beams: dead rows that follow beam 0
            self.beams.append(_Beam(self.beams[0].tokens if self.beams else (eos,), _NEG, frozenset(), None))
            parents.append(parents[0] if parents else 0)
        self.done = last_step or not chosen or self._cannot_improve()
        return torch.tensor(parents, device=self.device)

    def _finish(self, beam: _Beam) -> None:
        score = beam.score / len(beam.tokens) ** self.s.length_penalty
        self.finished.append((score, beam.tokens))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[self.s.num_beams:]

    def _allocate(self, candidates: list[tuple[_Beam, int]], nb: int) -> list[tuple[_Beam, int]]:
        banks: dict[int, list[tuple[_Beam, int]]] = {}
        for cand in sorted(candidates, key=lambda c: -c[0].score):
            banks.setdefault(self._placed(cand[0]), []).append(cand)
        if not banks:
            return []
        served = sorted(banks, reverse=True)
        if len(served) > nb:
            # More banks than beams (a term of nb or more tokens): the most advanced bank, which finishes, and then
            # the banks whose best candidates score highest. Serving the most advanced ones instead would drop the
            # hypotheses that have placed nothing yet, and with them every term placed where the model would place
            # it: each surviving hypothesis would have started its term at the first steps.
            rest = sorted(served[1:], key=lambda bank: -banks[bank][0][0].score)[: nb - 1]
            served = sorted([served[0], *rest], reverse=True)
        share = max(nb // len(served), 1)
        chosen = [c for bank in served for c in banks[bank][:share]][:nb]
        taken = {id(c[0]) for c in chosen}
        rest = sorted((c for c in candidates if id(c[0]) not in taken), key=lambda c: -c[0].score)
        chosen += rest[: nb - len(chosen)]
        return sorted(chosen, key=lambda c: -c[0].score)

    def _cannot_improve(self) -> bool:
        """Enough finished hypotheses, and no running one can beat the worst of them (scored at its current
        length, as `BeamSearch` does with early_stopping False)."""
        if len(self.finished) < self.s.num_beams:
            return False
        best_running = max(b.score for b in self.beams) / (self.cur_len - 1) ** self.s.length_penalty
        return best_running <= self.finished[-1][0]
