"""Train the bundled English → German and German → English translators (Vaswani encoder-decoder, shared
BPE vocabulary); both read the same pairs, one each way.

Data: Ding dictionary examples and LibreOffice help/UI strings (see `training.data`). Batches are
built from length buckets up to a token budget, so little compute is spent on padding, which matters
most on CPU. Loss: label-smoothed cross-entropy on the target tokens (pads ignored). The checkpoint
ships generation defaults for beam search (4 beams) with pad and `<s>` banned.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tserve.model.checkpoint import GenerationDefaults, save_checkpoint
from tserve.model.config import Seq2SeqConfig
from tserve.model.seq2seq import Seq2Seq
from tserve.model.tokenizer import HFTokenizer
from tserve.training import data as data_mod
from tserve.training.bpe import encode_batch, train_translation_tokenizer
from tserve.training.card import record_run
from tserve.training.common import (
    RunOptions,
    configure_threads,
    count_parameters,
    hardware_description,
    load_init,
    log_event,
    plan_loop,
    record_init,
    resolve_device,
    seed_everything,
    set_dropout,
    validation_items,
)
from tserve.training.data.pairs import LANGUAGE_NAMES
from tserve.training.loop import LoopConfig, train_loop

SOURCES = ["ding", "lo-help-en", "lo-help-de", "lo-ui"]


def direction_languages(direction: str) -> tuple[str, str]:
    """"en-de" -> ("en", "de"): the (source, target) codes a trainer reads the pairs in."""
    source, _, target = direction.partition("-")
    if {source, target} != {"en", "de"}:
        raise ValueError(f"unknown direction {direction!r}; expected en-de or de-en")
    return source, target


@dataclass
class MTPreset:
    model: dict[str, Any]
    vocab_size: int = 8000
    max_len: int = 96  # tokens per side (longer pairs are dropped from training)
    batch_tokens: int = 3000  # source + target tokens per batch, padding included
    epochs: float = 1.0
    loop: LoopConfig = field(default_factory=LoopConfig)
    label_smoothing: float = 0.1
    val_pairs: int = 500


def preset(name: str) -> MTPreset:
    if name == "cpu":
        return MTPreset(
            model=dict(d_model=256, n_heads=4, d_ff=768, n_encoder_layers=3, n_decoder_layers=3),
            vocab_size=8000, max_len=64, batch_tokens=3000, epochs=2.0,
            loop=LoopConfig(lr=1.5e-3, warmup_steps=300, weight_decay=0.01, betas=(0.9, 0.98), eval_every=500,
                            log_every=50),
        )
    if name == "gpu":
        return MTPreset(
            model=dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6, dropout=0.1),
            vocab_size=16000, max_len=128, batch_tokens=16000, epochs=30,
            loop=LoopConfig(lr=7e-4, warmup_steps=4000, schedule="vaswani", weight_decay=0.0, betas=(0.9, 0.98),
                            eval_every=1000, log_every=100),
        )
    raise ValueError(f"unknown preset {name!r}; expected cpu or gpu")


def encode_pairs(tokenizer: HFTokenizer, pairs: Sequence[data_mod.TranslationPair], max_len: int | None = None,
                 languages: tuple[str, str] = ("en", "de")) -> list[tuple[list[int], list[int]]]:
    """(source ids + eos, target ids + eos), sides as `languages` says; pairs with a side over `max_len`
    tokens are dropped."""
    eos = tokenizer.eos_id
    src = encode_batch(tokenizer, [p.side(languages[0]) for p in pairs])
    tgt = encode_batch(tokenizer, [p.side(languages[1]) for p in pairs])
    out = []
    for s, t in zip(src, tgt, strict=True):
        s, t = s + [eos], t + [eos]
        if max_len is None or (len(s) <= max_len and len(t) <= max_len):
            out.append((s, t))
    return out


def make_batches(examples: Sequence[tuple[list[int], list[int]]], batch_tokens: int, g: torch.Generator
                 ) -> list[list[int]]:
    """Index batches: examples sorted by length (with random tie-breaking), cut where the padded size
    (rows x (longest source + longest target)) would pass `batch_tokens`, then shuffled."""
    noise = torch.rand(len(examples), generator=g).tolist()
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]) + len(examples[i][1]), noise[i]))
    batches: list[list[int]] = []
    cur: list[int] = []
    ms = mt = 0
    for i in order:
        s, t = len(examples[i][0]), len(examples[i][1])
        if cur and (len(cur) + 1) * (max(ms, s) + max(mt, t) + 1) > batch_tokens:
            batches.append(cur)
            cur, ms, mt = [], 0, 0
        cur.append(i)
        ms, mt = max(ms, s), max(mt, t)
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


def collate(examples: Sequence[tuple[list[int], list[int]]], pad: int, bos: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> src (B, S), src_lengths (B,), decoder input (B, T) starting with bos, labels (B, T) padded with -100."""
    B = len(examples)
    S = max(len(s) for s, _ in examples)
    T = max(len(t) for _, t in examples)
    src = torch.full((B, S), pad, dtype=torch.long)
    tgt_in = torch.full((B, T), pad, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for i, (s, t) in enumerate(examples):
        src[i, : len(s)] = torch.tensor(s)
        tgt_in[i, 0] = bos
        tgt_in[i, 1 : len(t)] = torch.tensor(t[:-1])
        labels[i, : len(t)] = torch.tensor(t)
    lengths = torch.tensor([len(s) for s, _ in examples])
    return src, lengths, tgt_in, labels


def batch_iterator(examples: Sequence[tuple[list[int], list[int]]], batch_tokens: int, pad: int, bos: int,
                   g: torch.Generator) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
    while True:
        for idx in make_batches(examples, batch_tokens, g):
            yield collate([examples[i] for i in idx], pad, bos)


def mt_loss(model: Seq2Seq, batch: tuple[Tensor, Tensor, Tensor, Tensor], device: torch.device,
            label_smoothing: float) -> tuple[Tensor, int]:
    src, lengths, tgt_in, labels = (t.to(device) for t in batch)
    logits = model(src, lengths, tgt_in)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                           label_smoothing=label_smoothing)
    return loss, int(lengths.sum()) + int((labels != -100).sum())


@torch.no_grad()
def mean_nll(model: Seq2Seq, examples: Sequence[tuple[list[int], list[int]]], pad: int, bos: int,
             batch_size: int = 64) -> float:
    """Mean target-token negative log-likelihood (nats, no smoothing)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        src, lengths, tgt_in, labels = (t.to(device) for t in collate(examples[i : i + batch_size], pad, bos))
        logits = model(src, lengths, tgt_in).float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                                       reduction="sum"))
        count += int((labels != -100).sum())
    return total / max(1, count)


def generation_defaults(tokenizer: HFTokenizer, max_new_tokens: int = 128) -> GenerationDefaults:
    banned = [i for i in (tokenizer.pad_id, tokenizer.bos_id) if i is not None]
    return GenerationDefaults(num_beams=4, max_new_tokens=max_new_tokens, length_penalty=1.0, early_stopping=False,
                              banned_token_ids=banned)


def train(opts: RunOptions, *, pairs: dict[str, list[data_mod.TranslationPair]] | None = None,
          config: MTPreset | None = None) -> Path:
    """Train tokenizer and translator and save checkpoint + card to `opts.out`."""
    configure_threads()
    device = resolve_device(opts.device)
    p = config or preset(opts.preset)
    if opts.batch is not None:
        p = replace(p, batch_tokens=opts.batch)
    g = seed_everything(opts.seed)
    t0 = time.perf_counter()
    splits = pairs if pairs is not None else data_mod.load_translation_pairs(opts.data_root)
    train_pairs, valid_pairs, validated_on = validation_items(splits, lambda pair: pair.en)
    init = load_init(opts, "seq2seq")
    inherited = "-".join(init.languages) if init is not None and init.languages else None
    direction = opts.direction or inherited or "en-de"
    languages = direction_languages(direction)
    if init is not None:
        tokenizer = init.tokenizer
    else:
        tokenizer = train_translation_tokenizer((t for pair in train_pairs for t in (pair.en, pair.de)),
                                                vocab_size=p.vocab_size)
    pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
    assert pad is not None and bos is not None and eos is not None
    examples = encode_pairs(tokenizer, train_pairs, p.max_len, languages)
    val_examples = encode_pairs(tokenizer, valid_pairs[: p.val_pairs], p.max_len,
                                languages)
    n_tokens = sum(len(s) + len(t) for s, t in examples)
    log_event("data_ready", train_pairs=len(examples), dropped=len(train_pairs) - len(examples),
              train_tokens=n_tokens, vocab=tokenizer.vocab_size, seconds=round(time.perf_counter() - t0, 1))

    cfg = Seq2SeqConfig(vocab_size=tokenizer.vocab_size, max_source_len=max(256, p.max_len),
                        max_target_len=max(256, p.max_len), decoder_start_token_id=bos, eos_token_id=eos,
                        pad_token_id=pad, **p.model)
    model = Seq2Seq(cfg) if init is None else init.model.train()
    set_dropout(model, opts.dropout)
    cfg = model.cfg
    loop = LoopConfig(**{**asdict(p.loop), "betas": tuple(p.loop.betas), "d_model": cfg.d_model})
    n_batches = len(make_batches(examples, p.batch_tokens, torch.Generator().manual_seed(0)))
    plan_loop(loop, opts, None, p.epochs, n_batches, 1)
    out = Path(opts.out)
    generation = generation_defaults(tokenizer)
    info: dict[str, Any] = {
        "task": "translation", "preset": opts.preset, "seed": opts.seed, "command": opts.command, "sources": SOURCES,
        "parameters": count_parameters(model), "hardware": hardware_description(device),
        "validated_on": validated_on,
        "data": {"train_pairs": len(examples), "train_tokens": n_tokens, "batches_per_epoch": n_batches,
                 "valid_pairs": len(valid_pairs), "test_pairs": len(splits.get("test", []))},
        "hyperparameters": {"vocab_size": tokenizer.vocab_size, "max_len": p.max_len, "batch_tokens": p.batch_tokens,
                            "label_smoothing": p.label_smoothing, "loop": asdict(loop)},
        "direction": direction,
        "description": f"{LANGUAGE_NAMES[languages[0]]} → {LANGUAGE_NAMES[languages[1]]} transformer translator "
                       "trained from scratch; decode with beam search (4 beams, generation.json).",
    }
    record_init(info, opts)

    def validate(m: Seq2Seq) -> dict[str, float]:
        return {"val_loss": mean_nll(m, val_examples, pad, bos)}

    def save(m: Seq2Seq, step: int) -> None:
        save_checkpoint(out, m, tokenizer=tokenizer, generation=generation, languages=languages)

    result = train_loop(model, batch_iterator(examples, p.batch_tokens, pad, bos, g),
                        lambda m, b: mt_loss(m, b, device, p.label_smoothing), loop, device=device, unit="tok",
                        validate=validate, save=save, desc="translation",
                        start_checkpoint=init is not None)
    info.update(steps=result.steps, kept_step=result.kept_step, seconds=round(result.seconds, 1), final_loss=round(result.final_loss, 4),
                stopped_early=result.stopped_early, validation=result.validations, history=result.history,
                epochs_seen=round(result.steps / n_batches, 2))
    record_run(out, info)
    log_event("run_done", path=str(out), kept_step=result.kept_step)
    return out
