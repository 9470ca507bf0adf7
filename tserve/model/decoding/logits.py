"""The logits pipeline: every rule that shapes next-token scores, in one ordered list, applied to a
(rows, vocab) tensor whose rows may belong to different requests with different parameters.

Order (vLLM's and OpenAI's): the constraints first, then the sampling shape.
    constraints   presence/frequency penalties, logit_bias, eos ban (min_tokens / ignore_eos), the
                  checkpoint's banned ids, forced eos at the length limit, a grammar's token mask
    shape         temperature, top-k, top-p (sampled rows only)
Reported logprobs and beam search read the scores after the constraints. Every processor looks at its
rows' parameters on the host first and costs nothing when no row uses it; none changes its input in place.
A row that no constraint touches beyond the checkpoint's banned ids (`whole_rows`) needs no pass over its whole
distribution for greedy or beam choices: `top_tokens` takes its best tokens from the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from tserve.model.decoding.params import SamplingParams
from tserve.model.decoding.structured import disallowed
from tserve.model.device_inputs import to_device


class DecodingRow(Protocol):
    """What the processors need to know about the request a row belongs to."""

    params: SamplingParams

    @property
    def num_generated(self) -> int:
        """Tokens generated so far (the index of the token being chosen)."""

    def token_counts(self, vocab_size: int, device: torch.device) -> Tensor:
        """(vocab,) how often each token was generated so far (for the penalties)."""


class LogitsPipeline:
    """The rules of one model: its eos token and its checkpoint's banned ids / forced eos; the rest comes
    from each row's `SamplingParams`."""

    def __init__(self, eos_token_id: int | Sequence[int] | None, banned_token_ids: Sequence[int] = (),
                 force_eos_at_max: bool = False) -> None:
        # Every id that ends a sequence (generation_config.json may name several); the first is forced.
        self.eos_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) \
            else list(eos_token_id)
        self.banned = list(banned_token_ids)
        self.force_eos_at_max = force_eos_at_max and bool(self.eos_ids)
        self._eos_tensors: dict[torch.device, Tensor] = {}
        self.constraints = [self.penalties, self.logit_bias, self.ban_eos, self.ban_ids, self.force_eos,
                            self.force_first, self.grammar]
        self.shaping = [self.temperature, self.top_k_top_p]

    def __call__(self, scores: Tensor, rows: Sequence[DecodingRow]) -> Tensor:
        """Scores to sample from: constraints, then shape."""
        return self.shape(self.constrain(scores, rows), rows)

    def constrain(self, scores: Tensor, rows: Sequence[DecodingRow], *, owned: bool = False) -> Tensor:
        """The constraints only (float32): what logprobs report and beam search reads. `owned`: the caller hands
        `scores` over (a step's fresh logits, read nowhere else), and a ban writes into it instead of into a copy
        (a whole vocabulary copied for one id is most of what `ignore_eos` cost a step). A processor's own copy is
        the next ones' to write into either way."""
        given = scores
        # A step's logits made in inference mode take writes only in inference mode: elsewhere they are copied.
        owned = owned and (torch.is_inference_mode_enabled() or not scores.is_inference())
        scores = scores.float()  # a no-op for float32 logits; every processor keeps the dtype
        for processor in self.constraints:
            scores = processor(scores, rows, owned or scores is not given)
        return scores

    def whole_rows(self, rows: Sequence[DecodingRow]) -> list[bool]:
        """Per row: does a constraint other than the checkpoint's banned ids apply to it this step? Those rows'
        choices read their whole constrained distribution; the others' are their raw logits with the banned
        ids left out (`top_tokens`), which is what the constraints would give them."""
        return [self._eos_banned(r) or self._reshapes(r) for r in rows]

    def exclusions(self, rows: Sequence[DecodingRow]) -> list[list[int]] | None:
        """Per row, the ids the constraints rule out this step (the checkpoint's banned ids; eos under min_tokens or
        ignore_eos) when ruling ids out is all they do to every row, else None. A greedy row's choice is then the
        argmax of its raw logits over the other ids, with no pass of the constraints over its vocabulary."""
        if any(self._reshapes(r) for r in rows):
            return None
        return [self.banned + self.eos_ids if self._eos_banned(r) else self.banned for r in rows]

    def _reshapes(self, row: DecodingRow) -> bool:
        """Does a constraint do more to the row's scores this step than rule ids out (penalties, bias, forced eos or
        first token, a grammar's mask)?"""
        return row.params.penalized or bool(row.params.logit_bias) or self._eos_forced(row) or \
            _forced_first(row) is not None or _token_mask(row) is not None

    def banned_ids(self, device: torch.device) -> Tensor | None:
        """The checkpoint's banned ids on `device` (None: none), for `top_tokens` to leave out."""
        return to_device(self.banned, device) if self.banned else None

    def shape(self, constrained: Tensor, rows: Sequence[DecodingRow]) -> Tensor:
        for processor in self.shaping:
            constrained = processor(constrained, rows)
        return constrained

    # ----------------------------------------------------------------------------------------------
    # Constraints
    # ----------------------------------------------------------------------------------------------
    @staticmethod
    def penalties(scores: Tensor, rows: Sequence[DecodingRow], owned: bool = False) -> Tensor:
        """OpenAI: logit -= frequency * count + presence * (count > 0)."""
        idx = [i for i, r in enumerate(rows) if r.params.penalized]
        if not idx:
            return scores
        dev, V = scores.device, scores.size(-1)
        counts = torch.stack([rows[i].token_counts(V, dev) for i in idx])
        presence = to_device([rows[i].params.presence_penalty for i in idx], dev)
        frequency = to_device([rows[i].params.frequency_penalty for i in idx], dev)
        penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0).to(scores.dtype)
        return scores.index_add(0, to_device(idx, dev), -penalty)

    @staticmethod
    def logit_bias(scores: Tensor, rows: Sequence[DecodingRow], owned: bool = False) -> Tensor:
        entries = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
        if not entries:
            return scores
        dev = scores.device
        i, t, b = zip(*entries, strict=True)
        return scores.index_put((to_device(i, dev), to_device(t, dev)),
                                to_device(b, dev, scores.dtype), accumulate=True)

    def ban_eos(self, scores: Tensor, rows: Sequence[DecodingRow], owned: bool = False) -> Tensor:
        """No eos before min_tokens, nor ever with ignore_eos."""
        if not self.eos_ids:
            return scores
        idx = [i for i, r in enumerate(rows) if self._eos_banned(r)]
        if not idx:
            return scores
        if len(idx) == scores.size(0):  # every row (ignore_eos on all of them): one fill, no index tensors of rows
            fill = scores.index_fill_ if owned else scores.index_fill
            return fill(-1, self._eos_on(scores.device), float("-inf"))
        dev = scores.device
        rows_, ids = zip(*((i, e) for i in idx for e in self.eos_ids), strict=True)
        put = scores.index_put_ if owned else scores.index_put
        return put((to_device(rows_, dev), to_device(ids, dev)), to_device(float("-inf"), dev))

    def _eos_on(self, device: torch.device) -> Tensor:
        """The eos ids as a tensor on `device`, made once per device."""
        if device not in self._eos_tensors:
            self._eos_tensors[device] = to_device(list(self.eos_ids), device)
        return self._eos_tensors[device]

    def _eos_banned(self, row: DecodingRow) -> bool:
        return bool(self.eos_ids) and (row.params.ignore_eos or row.num_generated < row.params.min_tokens)

    def ban_ids(self, scores: Tensor, rows: Sequence[DecodingRow], owned: bool = False) -> Tensor:
        """Ids the checkpoint never generates (Marian: pad)."""
        if not self.banned:
            return scores
        fill = scores.index_fill_ if owned else scores.index_fill
        return fill(-1, to_device(self.banned, scores.device), float("-inf"))

    def force_eos(self, scores: Tensor, rows: Sequence[DecodingRow], owned: bool = False) -> Tensor:
        """Marian's forced_eos_token_id: at a row's last position only eos may come (scored 0, as
        transformers does)."""
        if not self.force_eos_at_max:
            return scores
        last = [self._eos_forced(r) for r in rows]
        if not any(last):
            return scores
        only_eos = torch.full_like(scores[0], float("-inf"))
        only_eos[self.eos_ids[0]] = 0.0
        return torch.where(to_device(last, scores.device)[:, None], only_eos, scores)

    def _eos_forced(self, row: DecodingRow) -> bool:
        return self.force_eos_at_max and row.num_generated == row.params.max_tokens - 1

    @staticmethod
    def force_first(scores: Tensor, rows: Sequence[DecodingRow], owned: bool = False) -> Tensor:
        """A row's forced first token (a multilingual translator's target language, `forced_bos_token_id`):
        at its first step only that token may come, scored 0, as transformers does."""
        forced = [(i, t) for i, r in enumerate(rows) if (t := _forced_first(r)) is not None]
        if not forced:
            return scores
        dev = scores.device
        idx, tokens = (to_device(x, dev) for x in zip(*forced, strict=True))
        only = torch.full((len(forced), scores.size(-1)), float("-inf"), device=dev, dtype=scores.dtype)
        only[torch.arange(len(forced), device=dev), tokens] = 0.0
        return scores.index_copy(0, idx, only)

    def grammar(self, scores: Tensor, rows: Sequence[DecodingRow], owned: bool = False) -> Tensor:
        """Structured output: a row with a grammar may take only the tokens its bitmask allows (`token_mask`,
        set by the runner for this step). Where nothing else is left (the grammar is complete but eos is
        banned by min_tokens), eos is: the grammar wins."""
        masked = [(i, m) for i, r in enumerate(rows) if (m := _token_mask(r)) is not None]
        if not masked:
            return scores
        dev = scores.device
        idx = to_device([i for i, _ in masked], dev)
        banned = disallowed(torch.stack([m for _, m in masked]).to(dev), scores.size(-1))
        rows_scores = scores.index_select(0, idx).masked_fill(banned, float("-inf"))
        if self.eos_ids:
            dead = torch.isinf(rows_scores).all(-1, keepdim=True) & ~banned[:, self.eos_ids]
            rows_scores[:, self.eos_ids] = torch.where(dead, 0.0, rows_scores[:, self.eos_ids])
        return scores.index_copy(0, idx, rows_scores)

    # ----------------------------------------------------------------------------------------------
    # Shape (sampled rows only: a greedy row takes the argmax of its constrained scores)
    # ----------------------------------------------------------------------------------------------
    @staticmethod
    def temperature(scores: Tensor, rows: Sequence[DecodingRow]) -> Tensor:
        temps = [1.0 if r.params.greedy else r.params.temperature for r in rows]
        if all(t == 1.0 for t in temps):
            return scores
        return scores / to_device(temps, scores.device)[:, None]

    @staticmethod
    def top_k_top_p(scores: Tensor, rows: Sequence[DecodingRow]) -> Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.filtered]
        if not idx:
            return scores
        dev = scores.device
        rows_t = to_device(idx, dev)
        top_k = to_device([max(rows[i].params.top_k, 0) for i in idx], dev)
        top_p = to_device([rows[i].params.top_p for i in idx], dev)
        return scores.index_copy(0, rows_t, filter_top_k_top_p(scores[rows_t], top_k, top_p))


def _forced_first(row: DecodingRow) -> int | None:
    """The row's forced token at this step, if any (only at its first)."""
    token = getattr(row, "forced_first_token", None)
    return token if token is not None and row.num_generated == 0 else None


def _token_mask(row: DecodingRow) -> Tensor | None:
    return getattr(row, "token_mask", None)


def filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside the nucleus top-p of what top-k kept (its mass
    measured on the top-k tokens' renormalised distribution, as vLLM and transformers measure it). top_k 0 = off,
    top_p 1 = off. The most likely token is always kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.size(-1)
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    remove = ranks >= k
    probs = torch.softmax(sorted_logits.float().masked_fill(remove, float("-inf")), dim=-1)
    # Remove a token when the mass of the tokens before it already reaches top_p.
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
