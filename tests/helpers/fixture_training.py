"""Brief training that gives the tiny test models real behaviour.

Random tiny models ignore their context: their outputs hinge on the last token (or on nothing), so tests
that compare "batched" with "alone" or "cached" with "uncached" would compare constants. These models are
trained for a few hundred steps, once per test process, on tasks whose answers depend on the whole input:

- language models learn a fixed cycle of ten sentences (`CYCLE`). Words such as "the", "is" or "." occur in
  several sentences, so the next token depends on more than the last one, and a prefix of the cycle has
  one right continuation, predicted with a wide margin (no near-ties between batch shapes);
- translators learn a word-for-word English -> German lexicon (`LEXICON`) over random word sequences.
  Source and target are split into different sub-words, so the decoder must follow both the source
  (cross-attention) and what it has already written (its own cache); a few hundred steps leave the
  distributions soft enough that beam search finds other answers than greedy decoding.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

CYCLE = [
    "The quick brown fox jumps over the lazy dog.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Hello world, this is a small test corpus for tokenizers.",
    "Hallo Welt, dies ist ein kleiner Testkorpus für Tokenizer.",
    "Good morning. Where is the station? I don't know.",
    "Guten Morgen. Wo ist der Bahnhof? Ich weiß es nicht.",
    "The weather is nice today, isn't it?",
    "Das Wetter ist heute schön, nicht wahr?",
    "Once upon a time there was a king who had three daughters.",
    "Es war einmal ein König, der hatte drei Töchter.",
]
CYCLE_TEXT = " ".join(CYCLE) + " "

LEXICON = {
    "the": "der", "quick": "schnelle", "brown": "braune", "fox": "Fuchs", "jumps": "springt", "over": "über",
    "lazy": "faulen", "dog": "Hund", "hello": "Hallo", "world": "Welt", "good": "Guten", "morning": "Morgen",
    "where": "wo", "is": "ist", "station": "Bahnhof", "weather": "Wetter", "today": "heute", "nice": "schön",
    "king": "König", "three": "drei", "daughters": "Töchter", "small": "kleiner", "know": "weiß", "time": "Zeit",
}

STEPS = 400


def cycle_windows(ids: list[int], length: int, batch: int, rng: random.Random, bos: int | None) -> Iterator[Tensor]:
    """Windows of `length` + 1 tokens of the endlessly repeated id sequence `ids`, each starting anywhere
    in it, behind `bos` when the tokenizer starts prompts with one."""
    head = [] if bos is None else [bos]
    n = length + 1 - len(head)
    stream = ids * (n // len(ids) + 2)
    while True:
        starts = [rng.randrange(len(ids)) for _ in range(batch)]
        yield torch.tensor([head + stream[s : s + n] for s in starts])


def lexicon_pair(rng: random.Random, max_words: int = 8) -> tuple[str, str]:
    words = rng.choices(list(LEXICON), k=rng.randint(1, max_words))
    return " ".join(words), " ".join(LEXICON[w] for w in words)


def fit(model: torch.nn.Module, loss_of_batch: Callable[[int], Tensor], steps: int = STEPS, lr: float = 5e-3) -> float:
    """Adam with a short warm-up and linear decay; returns the last loss."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    loss = torch.tensor(0.0)
    for step in range(steps):
        loss = loss_of_batch(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return float(loss.detach())


def train_causal_lm(model: torch.nn.Module, cycle_ids: list[int], bos: int | None,
                    logits_of: Callable[[Tensor], Tensor], context: int, seed: int = 0, steps: int = STEPS) -> float:
    """Teach a causal LM the sentence cycle (`cycle_ids`: CYCLE_TEXT without special tokens).
    `logits_of(tokens (B, T)) -> (B, T, V)`."""
    rng = random.Random(seed)
    windows = cycle_windows(cycle_ids, min(context - 1, 48), 32, rng, bos)

    def loss(_: int) -> Tensor:
        batch = next(windows)
        logits = logits_of(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))

    return fit(model, loss, steps)


def train_translator(model: torch.nn.Module, encode_source: Callable[[str], list[int]],
                     encode_target: Callable[[str], list[int]], logits_of: Callable[[Tensor, Tensor, Tensor], Tensor],
                     pad: int, start: int, seed: int = 0, steps: int = STEPS, reverse: bool = False) -> float:
    """Teach an encoder-decoder the lexicon (`reverse`: German to English). Targets from `encode_target` end
    with eos; `logits_of(src (B, S), src_lengths (B,), decoder_input (B, T)) -> (B, T, V)`."""
    rng = random.Random(seed)
    pairs = [lexicon_pair(rng) for _ in range(2048)]
    pool = [(encode_source(t), encode_target(s)) if reverse else (encode_source(s), encode_target(t)) for s, t in pairs]
    return _fit_pairs(model, pool, logits_of, pad, start, rng, steps)


def train_translator_both_ways(model: torch.nn.Module, encode_source: Callable[[str, str], list[int]],
                               encode_target: Callable[[str, str], list[int]],
                               logits_of: Callable[[Tensor, Tensor, Tensor], Tensor], pad: int, start: int,
                               seed: int = 0, steps: int = STEPS, max_words: int = 8, lr: float = 5e-3) -> float:
    """Teach a multilingual encoder-decoder the lexicon in both directions: `encode_source(text, "en" | "de")`
    and `encode_target(text, language)` put the languages' codes where the model family wants them. (With a
    code in front of each side, a model finds the word-for-word alignment later than without: shorter
    sentences and more steps get it there.)"""
    rng = random.Random(seed)
    pool = []
    for i in range(2048):
        s, t = lexicon_pair(rng, max_words)
        pool.append((encode_source(t, "de"), encode_target(s, "en")) if i % 2 else
                    (encode_source(s, "en"), encode_target(t, "de")))
    return _fit_pairs(model, pool, logits_of, pad, start, rng, steps, lr)


def _fit_pairs(model: torch.nn.Module, pool: list[tuple[list[int], list[int]]],
               logits_of: Callable[[Tensor, Tensor, Tensor], Tensor], pad: int, start: int, rng: random.Random,
               steps: int, lr: float = 5e-3) -> float:
    def loss(_: int) -> Tensor:
        batch = rng.sample(pool, 32)
        S, T = (max(len(x[k]) for x in batch) for k in (0, 1))
        src = torch.full((32, S), pad)
        dec_in = torch.full((32, T), pad)
        labels = torch.full((32, T), -100)
        for i, (s, t) in enumerate(batch):
            src[i, : len(s)] = torch.tensor(s)
            dec_in[i, 0] = start
            dec_in[i, 1 : len(t)] = torch.tensor(t[:-1])
            labels[i, : len(t)] = torch.tensor(t)
        logits = logits_of(src, torch.tensor([len(s) for s, _ in batch]), dec_in)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100)

    return fit(model, loss, steps, lr)


# --------------------------------------------------------------------------------------------------
# Inputs for the tests, and the check that their outputs are not constants
# --------------------------------------------------------------------------------------------------
def cycle_prompts(n: int, seed: int = 0, min_words: int = 2, max_words: int = 12) -> list[str]:
    """`n` prompts cut from the sentence cycle at word boundaries, each ending at a different word, so
    each has its own continuation."""
    words = CYCLE_TEXT.split()
    rng = random.Random(seed)
    ends = rng.sample(range(max_words, len(words)), n)
    return [" ".join(words[end - rng.randint(min_words, max_words) : end]) for end in ends]


def lexicon_sentences(n: int, seed: int = 0, min_words: int = 1, max_words: int = 8) -> list[str]:
    """`n` different English word sequences over the lexicon."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        out[" ".join(rng.choices(list(LEXICON), k=rng.randint(min_words, max_words)))] = None
    return list(out)


def assert_varied(outputs: list, min_distinct: float = 0.9) -> None:
    """Guard of every equality test: the outputs it compares differ across its inputs (at least
    `min_distinct` of them distinct) and none is one token repeated, so equal results cannot come from a
    model that ignores its input."""
    keyed = [tuple(o) if isinstance(o, list) else o for o in outputs]
    assert len(set(keyed)) >= max(2, round(min_distinct * len(keyed))), f"outputs barely vary: {outputs}"
    for o in keyed:
        if isinstance(o, tuple) and len(o) > 2:
            assert len(set(o)) > 1, f"one token repeated: {o}"


def sentences_where_beams_matter(loaded, n: int, num_beams: int = 4, max_new_tokens: int = 30,  # noqa: ANN001
                                 seed: int = 11) -> list[str]:
    """Up to `n` lexicon sentences (5-10 words, longer than most training ones) whose `num_beams`-beam
    translation differs from the greedy one, for `loaded` (a translator from `model.checkpoint.load`).
    Fails when there is none: the fixture would be too sure of itself to test beam search."""
    from tserve.model.decoding import translate

    out = []
    for text in lexicon_sentences(40, seed=seed, min_words=5, max_words=10):
        src = loaded.tokenizer.encode(text)
        greedy, beams = (translate(loaded, [src], n, max_new_tokens)[0].output_ids for n in (1, num_beams))
        if beams != greedy:
            out.append(text)
            if len(out) == n:
                break
    assert out, f"{num_beams} beams never beat greedy decoding: the fixture is too sure to test beam search"
    return out


def lexicon_alignments(loaded, n: int, seed: int = 3):  # noqa: ANN001, ANN201 - a translator; KnownAlignments
    """`n` lexicon sentences and their word-for-word translations, whose alignment is known (word i to word
    i), as `model.alignment.KnownAlignment`s over the translator's tokens."""
    import re  # noqa: PLC0415

    from tserve.model.alignment import KnownAlignment, token_spans  # noqa: PLC0415

    tok, eos = loaded.tokenizer, loaded.config.eos_token_id
    out = []
    for source in lexicon_sentences(n, seed=seed, min_words=3, max_words=8):
        target = " ".join(LEXICON[w] for w in source.split())
        src_ids, tgt_ids = tok.encode(source), [t for t in tok.encode_target(target) if t != eos]
        src_spans, tgt_spans = token_spans(tok, src_ids, source), token_spans(tok, tgt_ids, target)
        src_words = [m.span() for m in re.finditer(r"\S+", source)]
        tgt_words = [m.span() for m in re.finditer(r"\S+", target)]
        gold = {}
        for t, (a, b) in enumerate(tgt_spans):
            w = next((i for i, (s, e) in enumerate(tgt_words) if a < b and s <= a < e), None)
            if w is not None:
                s, e = src_words[w]
                gold[t] = {j for j, (c, d) in enumerate(src_spans) if c < d and s <= c < e}
        out.append(KnownAlignment(src_ids, tgt_ids, gold))
    return out


# A greedy choice a test relies on must beat the runner-up by this much (in logits): the float rounding of
# another CPU's kernels, or of another batch shape, moves a logit by far less.
MIN_MARGIN = 1.0


def translation_margins(loaded, source: str, target: str) -> list[float]:  # noqa: ANN001
    """Teacher-forced on `target`'s tokens and then eos, given `source`: at each step, how far the logit of the
    token `target` takes lies above the best other token the decoder may pick (the checkpoint's banned
    tokens excluded). Negative where greedy decoding would pick another token."""
    tok, cfg = loaded.tokenizer, loaded.config
    ids = [t for t in tok.encode_target(target) if t != cfg.eos_token_id] + [cfg.eos_token_id]
    src = torch.tensor([tok.encode(source)])
    dec = torch.tensor([[cfg.decoder_start_token_id, *ids[:-1]]])
    with torch.inference_mode():
        logits = loaded.model(src, torch.tensor([src.size(1)]), dec)[0].float()
        logits[:, list(loaded.generation.banned_token_ids)] = float("-inf")
        chosen = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
        logits.scatter_(1, torch.tensor(ids)[:, None], float("-inf"))
        return (chosen - logits.amax(dim=1)).tolist()


def assert_greedy_margins(loaded, source: str, target: str, min_margin: float = MIN_MARGIN) -> None:  # noqa: ANN001
    """`target` is the greedy translation of `source` with at least `min_margin` at every step, so that no
    kernel's rounding can make it another."""
    margins = translation_margins(loaded, source, target)
    assert min(margins) >= min_margin, f"{source!r} -> {target!r}: margins {[round(m, 2) for m in margins]}"
