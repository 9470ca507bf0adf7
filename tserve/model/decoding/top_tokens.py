"""Each row's best tokens and its log-sum-exp straight from the raw logits, for the choices that need no more:
greedy (the argmax, and the chosen token's log-probability as logit - lse) and beam search (each beam's
2 * num_beams best tokens, their log-probabilities as logit - lse).

With NLLB's 256,206 outputs a (rows, V) float32 step is 1 MiB a row; `log_softmax` -> constraints -> `topk`
read and wrote it five times, costing more than the rest of the step beside the output GEMM. Here a block of
rows small enough to stay in the cache is read once from memory for the maxima of its 1024-column chunks, then
in the cache for its log-sum-exp; the best k tokens lie in the k chunks with the largest maxima (k + the number
of banned columns when some are left out), so `topk` reads a few thousand columns, not the whole row.

Which rows may take this path (those whose constraints only ban a fixed set of columns) is decided once, by
`LogitsPipeline.whole_rows`; the others get the full log-softmax and the constraints, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tserve.model.decoding.beam_search import BeamSearch
from tserve.model.decoding.constrained_beam import ConstrainedBeamSearch
from tserve.model.decoding.logits import DecodingRow, LogitsPipeline
from tserve.model.device_inputs import to_device

_CHUNK = 1024  # columns whose maximum is taken first (NLLB: 251 chunks a row)
_BLOCK_BYTES = 2 << 20  # rows read together: about a core's L2 cache, so the log-sum-exp reads them there


def greedy_tokens(pipeline: LogitsPipeline, logits: Tensor, places: Sequence[int],
                  rows: Sequence[DecodingRow]) -> tuple[Tensor, Tensor]:
    """Rows `places` of `logits` (one per row of `rows`): each row's argmax after the constraints, and that
    token's log-probability before them (logit - log-sum-exp of the raw row; a forced token gets the
    probability the model gave it). Returns tokens (n,), log-probs (n,)."""
    dev = logits.device
    values, ids, lse = top_tokens(logits, 1, places, pipeline.banned_ids(dev))
    tokens, chosen = ids[:, 0], values[:, 0]
    whole = [j for j, w in enumerate(pipeline.whole_rows(rows)) if w]
    if whole:
        at = to_device(whole, dev)
        scores = logits.index_select(0, to_device([places[j] for j in whole], dev))
        forced = pipeline.constrain(scores, [rows[j] for j in whole]).argmax(dim=-1)
        tokens = tokens.index_copy(0, at, forced)
        chosen = chosen.index_copy(0, at, scores.float().gather(1, forced[:, None])[:, 0])
    return tokens, chosen - lse


def advance_beams(pipeline: LogitsPipeline, searches: Sequence[BeamSearch | ConstrainedBeamSearch], logits: Tensor,
                  places: Sequence[int], rows: Sequence[DecodingRow]) -> Tensor:
    """One step of beam searches of one `group_key` whose beams are rows `places` of `logits` (one per row of
    `rows`): from each beam's best tokens (`beam_candidates`), or from the whole constrained log-softmax for a
    search that reads it (glossary constraints). Returns the parents (searches, num_beams)."""
    if searches[0].reads_whole_distribution:
        scores = logits.index_select(0, to_device(places, logits.device)).float()
        return type(searches[0]).advance_many(searches, pipeline.constrain(torch.log_softmax(scores, -1), rows))
    k = searches[0].tokens_per_beam(logits.size(-1))
    return BeamSearch.advance_top(searches, *beam_candidates(pipeline, logits, places, rows, k))


def beam_candidates(pipeline: LogitsPipeline, logits: Tensor, places: Sequence[int], rows: Sequence[DecodingRow],
                    k: int) -> tuple[Tensor, Tensor]:
    """Rows `places` of `logits` (one per beam row of `rows`): each row's k best tokens after the constraints,
    best first, and their log-probabilities (what `topk(constrain(log_softmax(row)), k)` gives, within float
    rounding). Rows that a constraint other than the banned ids touches take exactly that path.
    Returns log-probs (n, k), ids (n, k)."""
    dev = logits.device
    whole = pipeline.whole_rows(rows)
    fast = [j for j, w in enumerate(whole) if not w]
    slow = [j for j, w in enumerate(whole) if w]
    parts = []
    if fast:
        values, ids, lse = top_tokens(logits, k, [places[j] for j in fast], pipeline.banned_ids(dev))
        parts.append((fast, values - lse[:, None], ids))
    if slow:
        log_probs = torch.log_softmax(logits.index_select(0, to_device([places[j] for j in slow], dev)).float(), -1)
        parts.append((slow, *pipeline.constrain(log_probs, [rows[j] for j in slow]).topk(k, dim=-1)))
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    order = to_device([j for part in parts for j in part[0]], dev)
    values, ids = (torch.cat([part[i] for part in parts]) for i in (1, 2))
    return (torch.empty_like(values).index_copy_(0, order, values),
            torch.empty_like(ids).index_copy_(0, order, ids))


def top_tokens(logits: Tensor, k: int, places: Sequence[int] | None = None, banned: Tensor | None = None,
               lse: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """Of rows `places` of `logits` (rows, V) (every row when None): each row's k largest values and their
    ids, best first, leaving out the `banned` ids; and (`lse`) each row's log-sum-exp over every column (banned
    ones too, as `log_softmax` normalises before the constraints ban). For k == 1 the id is the lowest of the
    largest value's columns, as `argmax` gives it; for k > 1 the order of equal values is `topk`'s.
    Returns values (n, k), ids (n, k), lse (n,) or None; float32."""
    V, dev = logits.size(-1), logits.device
    n = logits.size(0) if places is None else len(places)
    by_row = list(range(n)) if places is None else sorted(range(n), key=places.__getitem__)
    first = places[by_row[0]] if places is not None and n else 0
    consecutive = places is None or all(places[j] == first + i for i, j in enumerate(by_row))
    block = max(n, 1) if dev.type != "cpu" else max(1, _BLOCK_BYTES // (4 * V))
    parts = []
    for start in range(0, n, block):
        if consecutive:  # read in place
            x = logits[first + start : first + min(start + block, n)]
        else:
            x = logits.index_select(0, to_device([places[j] for j in by_row[start : start + block]], dev))
        parts.append(_block_top_tokens(x.float(), k, banned, lse))
    if len(parts) > 1:
        parts = [(torch.cat([p[0] for p in parts]).view(n, k), torch.cat([p[1] for p in parts]).view(n, k),
                  torch.cat([p[2] for p in parts]) if lse else None)]
    values, ids, sums = parts[0]
    if by_row != list(range(n)):  # back to the order of `places`
        back = torch.empty(n, dtype=torch.long)
        back[torch.tensor(by_row)] = torch.arange(n)
        back = to_device(back, dev)
        values, ids, sums = values[back], ids[back], None if sums is None else sums[back]
    return values, ids, sums


def _block_top_tokens(x: Tensor, k: int, banned: Tensor | None,
                      lse: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    b, V = x.shape
    dev = x.device
    nbanned = 0 if banned is None else banned.numel()
    full = V // _CHUNK
    if full < 4 * (k + nbanned):  # a small vocabulary: the plain operations
        masked = x if banned is None else x.index_fill(-1, banned, float("-inf"))
        if k == 1:
            ids = masked.argmax(-1, keepdim=True)
            values = masked.gather(1, ids)
        else:
            values, ids = masked.topk(k, dim=-1)
        return values, ids, torch.logsumexp(x, dim=-1) if lse else None
    maxima = x[:, : full * _CHUNK].view(b, full, _CHUNK).amax(-1)
    if V > full * _CHUNK:
        maxima = torch.cat((maxima, x[:, full * _CHUNK :].amax(-1, keepdim=True)), 1)
    # The chunks of the k + nbanned largest maxima hold the k best allowed columns. Equal maxima: the lower
    # chunk first (a stable sort), so that k == 1 finds argmax's lowest column; then in column order.
    kc = min(k + nbanned, maxima.size(1))
    chunks = maxima.sort(dim=-1, descending=True, stable=True)[1][:, :kc].sort(dim=-1)[0]
    positions = (chunks[:, :, None] * _CHUNK + torch.arange(_CHUNK, device=dev)).view(b, kc * _CHUNK)
    outside = positions >= V  # the short last chunk
    positions = positions.clamp(max=V - 1)
    candidates = x.gather(1, positions).masked_fill_(outside, float("-inf"))
    if banned is not None:
        candidates.masked_fill_(torch.isin(positions, banned), float("-inf"))
    if k == 1:
        picked = candidates.argmax(-1, keepdim=True)
        values = candidates.gather(1, picked)
    else:
        values, picked = candidates.topk(k, dim=-1)
    return values, positions.gather(1, picked), _logsumexp(x, maxima.amax(-1)) if lse else None


def _logsumexp(x: Tensor, row_max: Tensor) -> Tensor:
    """`torch.logsumexp(x, -1)` given each row's maximum (from the chunk maxima: one pass fewer)."""
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)  # a row of -inf: lse -inf, not nan
    return torch.sub(x, shift[:, None]).exp_().sum(-1).log_().add_(shift)
