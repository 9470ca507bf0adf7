"""Each row's best tokens straight from the raw logits, for the choices that need no more: greedy (the argmax
and its log-probability) and beam search (each beam's 2 * num_beams best tokens and their log-probabilities).

With NLLB's 256,206 outputs a (rows, V) float32 step is 1 MiB a row; gathering the rows, `log_softmax`, the
constraints' copy and `topk` over the whole tensor read and wrote it about seven times, costing more than the
rest of the step beside the output GEMM. Here one pass takes the maxima of each row's chunks of columns (1024):
the best k tokens lie in the k chunks with the largest maxima (k + the number of banned columns when some are
left out) or in the short last chunk, so `topk` reads a few thousand columns, not the whole row. The rows'
log-softmax is then computed 32 rows at a time (in the cache) and read at those tokens only: the very values
(bitwise) the full path's log-softmax has there, with no (rows, V) tensor written. Few operations read the
whole tensor: on a shared CPU each parallel operation waits for both threads, so their number counts too.

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

# Columns whose maximum is taken first (NLLB: 250 chunks and a short one). A vocabulary of fewer than 4 chunks
# per token wanted (opus-mt's 15,900 for beams) takes the plain operations: on rows that small, gathering the
# chosen chunks costs as much as `topk` over the row.
_CHUNK = 1024
_BLOCK_BYTES = 32 << 20  # rows taken together (32 of NLLB's): few operations a step, the log-softmax in the L3 cache


def greedy_tokens(pipeline: LogitsPipeline, logits: Tensor, places: Sequence[int],
                  rows: Sequence[DecodingRow]) -> tuple[Tensor, Tensor]:
    """Rows `places` of `logits` (one per row of `rows`): each row's argmax after the constraints, and that
    token's log-probability before them (a forced token gets the probability the model gave it).
    Returns tokens (n,), log-probs (n,)."""
    dev = logits.device
    _, ids, log_probs = top_tokens(logits, 1, places, pipeline.banned_ids(dev))
    tokens, chosen = ids[:, 0], log_probs[:, 0]
    whole = [j for j, w in enumerate(pipeline.whole_rows(rows)) if w]
    if whole:  # the full path: the constrained argmax, read in the unconstrained log-softmax
        at = to_device(whole, dev)
        scores = logits.index_select(0, to_device([places[j] for j in whole], dev)).float()
        forced = pipeline.constrain(scores, [rows[j] for j in whole]).argmax(dim=-1)
        tokens = tokens.index_copy(0, at, forced)
        chosen = chosen.index_copy(0, at, torch.log_softmax(scores, -1).gather(1, forced[:, None])[:, 0])
    return tokens, chosen


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
    best first, and their log-probabilities: what `topk(constrain(log_softmax(row)), k)` gives (the order of
    equal values aside), which rows that a constraint other than the banned ids touches take.
    Returns log-probs (n, k), ids (n, k)."""
    dev = logits.device
    whole = pipeline.whole_rows(rows)
    fast = [j for j, w in enumerate(whole) if not w]
    slow = [j for j, w in enumerate(whole) if w]
    parts = []
    if fast:
        values, ids, log_probs = top_tokens(logits, k, [places[j] for j in fast], pipeline.banned_ids(dev))
        parts.append((fast, log_probs, ids))
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
               log_probs: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """Of rows `places` of `logits` (rows, V) (every row when None): each row's k largest values and their ids,
    best first, leaving out the `banned` ids; and (`log_probs`) their log-probabilities, normalised over every
    column (banned ones too, as the constraints ban after `log_softmax`). For k == 1 the id is the lowest of
    the largest value's columns, as `argmax` gives it; for k > 1 the order of equal values is `topk`'s.
    Returns values (n, k), ids (n, k), log-probs (n, k) or None; float32."""
    dev = logits.device
    n = logits.size(0) if places is None else len(places)
    if n == 0:  # (a one-token prompt's scores)
        empty = torch.empty(0, k, device=dev)
        return empty, torch.empty(0, k, dtype=torch.long, device=dev), empty if log_probs else None
    # The rows from the first to the last place, read in place, when that span is not much more than the
    # rows themselves (a beam group's rows, a step's greedy ones); else a copy of the rows.
    low, high = (0, n) if places is None else (min(places), max(places) + 1)
    if high - low <= 2 * n:
        x, at = logits[low:high], None if places is None else [p - low for p in places]
    else:
        x, at = logits.index_select(0, to_device(list(places), dev)), None
    values, ids = _top_of_rows(x.float(), k, banned)
    probs = log_probs_at(x.float(), ids) if log_probs else None
    if at is not None and at != list(range(x.size(0))):
        rows = to_device(at, dev)
        values, ids, probs = values[rows], ids[rows], None if probs is None else probs[rows]
    return values, ids, probs


def _top_of_rows(x: Tensor, k: int, banned: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each row's k best allowed values and ids. Few operations read the whole (rows, V) tensor: they are the
    costly ones (and, on a busy machine, each parallel operation waits for both threads)."""
    b, V = x.shape
    nbanned = 0 if banned is None else banned.numel()
    kb = k + nbanned  # the best k allowed columns are among the best k + nbanned
    chunk = _CHUNK
    full = V // chunk
    if full < 4 * kb:  # a small vocabulary: the plain operations
        candidates = x
    else:
        body = x[:, : full * chunk].view(b, full, chunk)
        maxima = body.amax(-1)
        # The chunks of the kb largest maxima hold the kb best columns of the body. k == 1: equal maxima, the
        # lower chunk first (a stable sort), then in column order, so that the first best column is argmax's.
        if k == 1:
            chunks = maxima.sort(dim=-1, descending=True, stable=True)[1][:, :kb].sort(dim=-1)[0]
        else:
            chunks = maxima.topk(kb, dim=-1)[1]
        candidates = body.gather(1, chunks[:, :, None].expand(b, kb, chunk)).view(b, kb * chunk)
        if V > full * chunk:  # the short last chunk is always a candidate (its columns come last)
            candidates = torch.cat((candidates, x[:, full * chunk :]), 1)
    if banned is None and k == 1:
        picked = candidates.argmax(-1, keepdim=True)
        values = candidates.gather(1, picked)
    else:
        values, picked = candidates.topk(kb, dim=-1)
    if full < 4 * kb:
        ids = picked
    else:  # a candidate's column: its chunk's first column + its place there, or past the body, in the tail
        in_chunk = chunks.gather(1, (picked // chunk).clamp(max=kb - 1)) * chunk + picked % chunk
        ids = torch.where(picked >= kb * chunk, picked - kb * chunk + full * chunk, in_chunk)
    if banned is None:
        return values, ids
    # Of the kb best, the allowed ones: k == 1, the lowest column among the largest values.
    values = values.masked_fill(torch.isin(ids, banned), float("-inf"))
    if k == 1:
        best = values.amax(-1, keepdim=True)
        first = torch.where(values == best, ids, x.size(-1)).amin(-1, keepdim=True)
        return best, first
    values, keep = values.topk(k, dim=-1)
    return values, ids.gather(1, keep)


def log_probs_at(x: Tensor, ids: Tensor) -> Tensor:
    """log_softmax(x) at `ids` (rows, m), a block of rows at a time, so that no (rows, V) tensor is written."""
    block = x.size(0) if x.device.type != "cpu" else max(1, _BLOCK_BYTES // (4 * x.size(-1)))
    if block >= x.size(0):
        return torch.log_softmax(x, dim=-1).gather(1, ids)
    return torch.cat([torch.log_softmax(x[i : i + block], dim=-1).gather(1, ids[i : i + block])
                      for i in range(0, x.size(0), block)])
