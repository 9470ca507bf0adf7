"""Decoding: batched sampling with per-request parameters, stop conditions, greedy decoding for both
generative architectures, and beam search for the encoder-decoder.

Sampling is vectorised over the batch; randomness comes from one `torch.Generator` per request, so a
seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.beam_search import BeamSearch, BeamSettings
from model.decoder import Decoder
from model.seq2seq import Seq2Seq


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics). temperature 0 = greedy."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report (0-5); None = no logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


# --------------------------------------------------------------------------------------------------
# Logits processing (batched)
# --------------------------------------------------------------------------------------------------
def apply_penalties(logits: Tensor, counts: Tensor, presence: Tensor, frequency: Tensor) -> Tensor:
    """OpenAI penalties: logit -= frequency * count + presence * (count > 0). counts (B, V)."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (-inf) tokens outside each row's top-k and nucleus top-p. top_k 0 = off, top_p 1 = off.
    The most likely token is always kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.size(-1)
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    remove = ranks >= k
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    # Remove a token when the mass of the tokens before it already reaches top_p.
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """Next token per row (B,). Rows with temperature 0 take the argmax; others sample from the
    tempered, filtered distribution with their own generator."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = (temperature > 0).nonzero(as_tuple=True)[0].tolist()
    if not sampled_rows:
        return greedy
    idx = torch.tensor(sampled_rows, device=logits.device)
    scaled = logits[idx].float() / temperature[idx, None]
    probs = torch.softmax(filter_top_k_top_p(scaled, top_k[idx], top_p[idx]), dim=-1)
    out = greedy.clone()
    for j, row in enumerate(sampled_rows):
        out[row] = torch.multinomial(probs[j], 1, generator=generators[row])[0]
    return out


def token_logprobs(logits: Tensor, tokens: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities of the chosen tokens (B,) and the top-n alternatives ((B, n) values, ids)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None])[:, 0]
    top_vals, top_ids = logp.topk(max(n, 1), dim=-1)
    return chosen, top_vals[:, :n], top_ids[:, :n]


class StopStrings:
    """Finds stop strings in streamed text. `feed(delta)` returns the text that is safe to emit (it can
    no longer become part of a stop string) and whether a stop string was hit; the stop string itself
    and anything after it are never emitted."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)], True
        keep = 0  # longest suffix of `text` that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


# --------------------------------------------------------------------------------------------------
# One-request loops (the engine in `service` runs the same steps for many requests at once)
# --------------------------------------------------------------------------------------------------
@torch.inference_mode()
def generate_tokens(
    model: Decoder,
    prompt: Sequence[int],
    params: SamplingParams,
    eos_token_id: int | None = None,
) -> Iterator[int]:
    """Yield generated token ids for one prompt (cached decoding). Stops at eos (unless ignored, and
    not before min_tokens), at max_tokens, or at the context limit."""
    device = model.lm_head.weight.device
    max_len = min(model.cfg.max_seq_len, len(prompt) + params.max_tokens)
    cache = model.new_cache(1, max_len)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    tokens = torch.tensor([list(prompt)], device=device)
    logits = model.prefill(tokens, torch.tensor([len(prompt)], device=device), cache, slots)
    gen = params.make_generator(device) if not params.greedy else None
    counts = torch.zeros(1, model.cfg.vocab_size, device=device)
    one = lambda x: torch.tensor([x], device=device, dtype=torch.float32)  # noqa: E731
    for i in range(max_len - len(prompt)):
        logits = logits.float()
        if params.penalized:
            logits = apply_penalties(logits, counts, one(params.presence_penalty), one(params.frequency_penalty))
        if eos_token_id is not None and (params.ignore_eos or i < params.min_tokens):
            logits[:, eos_token_id] = float("-inf")
        token = sample(
            logits, one(params.temperature), torch.tensor([params.top_k], device=device),
            one(params.top_p), [gen],
        )
        t = int(token[0])
        yield t
        if t == eos_token_id and not params.ignore_eos:
            return
        counts[0, t] += 1
        pos = torch.tensor([len(prompt) + i], device=device)
        if pos[0] + 1 >= max_len:
            return
        logits = model.decode_step(token, pos, cache, slots, kv_len=int(pos[0]) + 1)


def ban_tokens(scores: Tensor, banned: Sequence[int], step: int, max_new_tokens: int, eos: int | None,
               force_eos_at_max: bool) -> Tensor:
    """Marian-style processing of next-token scores: banned ids (e.g. pad) to -inf, and, when
    `force_eos_at_max`, only eos allowed at the last step (scores of eos set to 0, as HF does)."""
    if banned:
        scores[:, list(banned)] = float("-inf")
    if force_eos_at_max and eos is not None and step == max_new_tokens - 1:
        scores = torch.full_like(scores, float("-inf"))
        scores[:, eos] = 0.0
    return scores


def _pad_batch(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    out = torch.full((len(seqs), int(lengths.max())), pad, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return out, lengths


@torch.inference_mode()
def translate_greedy(
    model: Seq2Seq,
    sources: Sequence[Sequence[int]],
    max_new_tokens: int,
    banned_token_ids: Sequence[int] = (),
    force_eos_at_max: bool = False,
    on_step: Callable[[list[int | None]], None] | None = None,
) -> list[list[int]]:
    """Greedy decoding of a batch of source id lists; returns generated ids (eos included when hit).
    `on_step`, if given, receives each step's new token per row (None for rows already finished)."""
    cfg, device = model.cfg, model.lm_head.weight.device
    B = len(sources)
    src, src_len = _pad_batch(sources, cfg.pad_token_id, device)
    max_new_tokens = min(max_new_tokens, cfg.max_target_len)
    cache = model.new_cache(B, max_target_len=max_new_tokens, max_source_len=src.size(1))
    slots = torch.arange(B, device=device)
    model.start(src, src_len, cache, slots)
    tokens = torch.full((B,), cfg.decoder_start_token_id, device=device)
    outputs: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        pos = torch.full((B,), step, device=device)
        logits = model.decode_step(tokens, pos, cache, slots, slots, kv_len=step + 1).float()
        logits = ban_tokens(logits, banned_token_ids, step, max_new_tokens, cfg.eos_token_id, force_eos_at_max)
        tokens = logits.argmax(dim=-1)
        step_tokens: list[int | None] = []
        for i, t in enumerate(tokens.tolist()):
            step_tokens.append(None if done[i] else t)
            if not done[i]:
                outputs[i].append(t)
                done[i] = t == cfg.eos_token_id
        if on_step is not None:
            on_step(step_tokens)
        if all(done):
            break
    return outputs


@torch.inference_mode()
def beam_search(model: Seq2Seq, source: Sequence[int], settings: BeamSettings) -> list[int]:
    """Beam search for one source; returns the best hypothesis' generated ids (eos included when hit)."""
    cfg, device = model.cfg, model.lm_head.weight.device
    nb = settings.num_beams
    max_new = min(settings.max_new_tokens, cfg.max_target_len)
    cache = model.new_cache(nb, 1, max_target_len=max_new, max_source_len=len(source))
    src = torch.tensor([list(source)], device=device)
    model.start(src, torch.tensor([len(source)], device=device), cache, torch.zeros(1, dtype=torch.long, device=device))
    search = BeamSearch(settings, cfg.decoder_start_token_id, device=device)
    slots = torch.arange(nb, device=device)
    cross = torch.zeros(nb, dtype=torch.long, device=device)
    while not search.done:
        step = search.step_index
        pos = torch.full((nb,), step, device=device)
        logits = model.decode_step(search.last_tokens, pos, cache, slots, cross, kv_len=step + 1)
        parents = search.advance(torch.log_softmax(logits.float(), dim=-1))
        if parents is not None:
            cache.self_kv.copy_slots(slots[parents], slots)
    return search.best()
