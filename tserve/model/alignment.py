"""Word alignment from a translator's own cross-attention: which source token each target token was read from.

The decoder's cross-attention, teacher-forced on (source, translation), averaged over a few heads, points from
every target token to source tokens; the aligned source token is the one it attends to most. Not every head
aligns: some attend to the sentence end or spread out. Which heads do is measured, not assumed, on pairs whose
alignment is known (`choose_alignment_heads`), and kept in the checkpoint's generation.json
(`alignment_heads`, `alignment_offset`), as Whisper's checkpoints keep theirs. Without that choice every head
of the last decoder layer is averaged.

`alignment_offset` says which decoder position stands for a target token: 0 is the step that produced it
(its query is the previous token), 1 the step that reads it. Which is better depends on the model.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tserve.model.checkpoint import LoadedModel


@dataclass(frozen=True)
class KnownAlignment:
    """A (source ids, target ids) pair and the target positions whose source position is known."""

    source_ids: list[int]
    target_ids: list[int]
    gold: dict[int, set[int]]  # target position -> the source positions that are right for it


@dataclass(frozen=True)
class HeadChoice:
    heads: list[tuple[int, int]]  # (decoder layer, head)
    offset: int
    accuracy: float  # share of gold target positions aligned into their source positions


def cross_attention(loaded: LoadedModel, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                    layers: Sequence[int] | None = None, batch: int = 32) -> list[Tensor]:
    """For each (source ids, target ids) pair (eos dropped from the target): the decoder's cross-attention
    (layers, heads, len(target) + 1, len(source)), teacher-forced; query row i reads the decoder input at i
    (row 0: the start token). With `layers`, only those are computed (the others are zeros). Pairs run in
    batches of `batch` of similar lengths, so that a long one pads few short ones."""
    cfg, dev = loaded.config, loaded.device
    if not pairs:
        return []
    wanted = set(range(cfg.n_decoder_layers) if layers is None else layers)
    targets = [[t for t in tgt if t != cfg.eos_token_id][: cfg.max_target_len - 1] for _, tgt in pairs]
    order = sorted(range(len(pairs)), key=lambda i: (len(targets[i]), len(pairs[i][0])))
    out: list[Tensor | None] = [None] * len(pairs)
    for start in range(0, len(order), batch):
        chunk = order[start: start + batch]
        src_len = max(len(pairs[i][0]) for i in chunk)
        tgt_len = max(len(targets[i]) for i in chunk) + 1
        src = torch.full((len(chunk), src_len), cfg.pad_token_id, dtype=torch.long)
        dec = torch.full((len(chunk), tgt_len), cfg.pad_token_id, dtype=torch.long)
        for row, i in enumerate(chunk):
            src[row, : len(pairs[i][0])] = torch.tensor(list(pairs[i][0]))
            dec[row, : len(targets[i]) + 1] = torch.tensor([cfg.decoder_start_token_id, *targets[i]])
        lengths = torch.tensor([len(pairs[i][0]) for i in chunk])
        with torch.inference_mode():
            maps = loaded.model.cross_attention(src.to(dev), lengths.to(dev), dec.to(dev), wanted)
        some = next(iter(maps.values()))
        stacked = torch.stack([maps[layer] if layer in maps else torch.zeros_like(some)
                               for layer in range(cfg.n_decoder_layers)], 1).float().cpu()
        for row, i in enumerate(chunk):
            out[i] = stacked[row, :, :, : len(targets[i]) + 1, : len(pairs[i][0])]
    return out


def default_heads(loaded: LoadedModel) -> tuple[list[tuple[int, int]], int]:
    """The checkpoint's alignment heads and offset, else every head of the last decoder layer and offset 0."""
    g, cfg = loaded.generation, loaded.config
    if g.alignment_heads:
        return [(int(layer), int(head)) for layer, head in g.alignment_heads], g.alignment_offset
    return [(cfg.n_decoder_layers - 1, h) for h in range(cfg.n_heads)], 0


def _aligned(att: Tensor, heads: Sequence[tuple[int, int]], offset: int, n_target: int,
             content: Sequence[int]) -> list[int]:
    """Argmax over the `content` source columns of the heads' mean, for target positions 0..n_target-1."""
    layers, hs = zip(*heads, strict=True)
    mean = att[list(layers), list(hs)].mean(0)  # (T + 1, S)
    rows = mean[offset: offset + n_target][:, list(content)]
    return [content[j] for j in rows.argmax(-1).tolist()]


def align(loaded: LoadedModel, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
          heads: Sequence[tuple[int, int]] | None = None, offset: int | None = None) -> list[list[int]]:
    """For each (source ids, target ids) pair: the source position each target token (eos dropped) aligns to,
    never a special token of the source (its eos) unless the source has nothing else."""
    if heads is None:
        heads, chosen_offset = default_heads(loaded)
        offset = chosen_offset if offset is None else offset
    offset = offset or 0
    special = loaded.tokenizer.special_ids
    out = []
    for (src, _), att in zip(pairs, cross_attention(loaded, pairs), strict=True):
        n_target = att.size(2) - 1
        content = [j for j, t in enumerate(src) if t not in special] or list(range(len(src)))
        out.append(_aligned(att, heads, offset, n_target, content) if n_target else [])
    return out


def head_accuracy(loaded: LoadedModel, examples: Sequence[KnownAlignment]) -> dict[tuple[int, int, int], float]:
    """Share of gold target positions that each single (layer, head) with each offset aligns correctly."""
    atts = cross_attention(loaded, [(e.source_ids, e.target_ids) for e in examples])
    cfg, special = loaded.config, loaded.tokenizer.special_ids
    hits: dict[tuple[int, int, int], int] = {}
    total = 0
    for e, att in zip(examples, atts, strict=True):
        content = [j for j, t in enumerate(e.source_ids) if t not in special]
        n_target = att.size(2) - 1
        gold = {t: s for t, s in e.gold.items() if t < n_target}
        total += len(gold)
        for layer, head, offset in itertools.product(range(cfg.n_decoder_layers), range(cfg.n_heads), (0, 1)):
            picks = _aligned(att, [(layer, head)], offset, n_target, content)
            hits[(layer, head, offset)] = hits.get((layer, head, offset), 0) + sum(
                picks[t] in s for t, s in gold.items() if t < len(picks))
    return {k: v / max(total, 1) for k, v in hits.items()}


def alignment_accuracy(loaded: LoadedModel, examples: Sequence[KnownAlignment],
                       heads: Sequence[tuple[int, int]] | None = None, offset: int | None = None) -> float:
    """Share of gold target positions aligned into their source positions by `align`."""
    picks = align(loaded, [(e.source_ids, e.target_ids) for e in examples], heads, offset)
    right = total = 0
    for e, p in zip(examples, picks, strict=True):
        for t, s in e.gold.items():
            if t < len(p):
                total += 1
                right += p[t] in s
    return right / max(total, 1)


def choose_alignment_heads(loaded: LoadedModel, examples: Sequence[KnownAlignment],
                           max_heads: int = 6) -> HeadChoice:
    """The heads whose mean aligns `examples` best: heads ranked by their own accuracy (per offset), then the
    best-scoring prefix of that ranking of up to `max_heads` heads (a mean of several good heads is steadier
    than the best one alone)."""
    single = head_accuracy(loaded, examples)
    best: HeadChoice | None = None
    for offset in (0, 1):
        ranked = sorted(((acc, (layer, head)) for (layer, head, o), acc in single.items() if o == offset),
                        reverse=True)
        for k in range(1, min(max_heads, len(ranked)) + 1):
            heads = [h for _, h in ranked[:k]]
            acc = alignment_accuracy(loaded, examples, heads, offset)
            if best is None or acc > best.accuracy:
                best = HeadChoice(heads, offset, acc)
    assert best is not None
    return best


def token_spans(tokenizer, ids: Sequence[int], text: str) -> list[tuple[int, int]]:  # noqa: ANN001
    """The characters of `text` each token of `ids` (its encoding, or the ids that decode to it) covers, as
    (start, end) without the token's leading whitespace; (p, p) for tokens that show no text (specials).
    Prefixes are decoded; where the decoded text differs from `text` (normalisation), positions are mapped
    through a character alignment of the two."""
    ends = [len(tokenizer.decode(list(ids[: k + 1]))) for k in range(len(ids))]
    decoded = tokenizer.decode(list(ids))
    if decoded != text:
        import difflib  # noqa: PLC0415 - rare: only tokenizers that normalise

        to_text = [0] * (len(decoded) + 1)
        for a, b, size in difflib.SequenceMatcher(None, decoded, text, autojunk=False).get_matching_blocks():
            for k in range(size + 1):
                to_text[a + k] = b + k
        # Unmatched characters keep to the last matched one (a T5 / MADLAD `<2de>` tag in front: to the start).
        for i in range(1, len(to_text)):
            to_text[i] = max(to_text[i], to_text[i - 1])
        ends = [to_text[min(e, len(decoded))] for e in ends]
    spans, start = [], 0
    for end in ends:
        end = max(end, start)
        lead = start
        while lead < end and text[lead].isspace():
            lead += 1
        spans.append((lead, end))
        start = end
    return spans


@dataclass(frozen=True)
class SentencePair:
    """A source sentence and its translation: texts, ids, and the (start, end) of the words to align in each."""

    source_ids: list[int]
    target_ids: list[int]
    source_spans: list[tuple[int, int]]  # token_spans of the source ids in the source text
    target_spans: list[tuple[int, int]]  # ... of the target ids (eos dropped) in the target text
    source_words: list[tuple[int, int]]
    target_words: list[tuple[int, int]]


def _membership(spans: Sequence[tuple[int, int]], word_ranges: Sequence[tuple[int, int]]) -> Tensor:
    """(tokens, words): 1 where a token's characters overlap a word's."""
    m = torch.zeros(len(spans), len(word_ranges))
    for i, (s, e) in enumerate(spans):
        for j, (ws, we) in enumerate(word_ranges):
            if s < we and e > ws:
                m[i, j] = 1.0
    return m


def word_alignment(loaded: LoadedModel, pairs: Sequence[SentencePair]) -> list[list[int]]:
    """For each pair: the source word each target word aligns to (-1 where nothing can be said), from the
    attention mass of the alignment heads between the words' tokens."""
    heads, offset = default_heads(loaded)
    eos = loaded.config.eos_token_id
    atts = cross_attention(loaded, [(p.source_ids, p.target_ids) for p in pairs], [layer for layer, _ in heads])
    out = []
    layers, hs = zip(*heads, strict=True)
    for p, att in zip(pairs, atts, strict=True):
        target = [t for t in p.target_ids if t != eos]
        if not p.target_words:
            out.append([])
            continue
        if not p.source_words or not target:
            out.append([-1] * len(p.target_words))
            continue
        mean = att[list(layers), list(hs)].mean(0)[offset: offset + len(target)]  # (T, S)
        mass = _membership(p.target_spans[: len(target)], p.target_words).T @ mean @ _membership(
            p.source_spans, p.source_words)  # (target words, source words)
        best = mass.argmax(-1).tolist()
        out.append([b if mass[i].sum() > 0 else -1 for i, b in enumerate(best)])
    return out
