"""Train the bundled English language model (GPT-style decoder) on Shakespeare, Jane Austen and fortunes.

The training chunks are tokenised once with a byte-level BPE trained on them and concatenated into one
token stream, documents separated by `<|endoftext|>`; batches are random windows of `context + 1`
tokens. With a compute budget of minutes on one CPU thread the model is deliberately small: a smaller
model that sees more tokens beats a larger one that sees fewer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tserve.model.checkpoint import GenerationDefaults, save_checkpoint
from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.model.tokenizer import HFTokenizer
from tserve.training import data as data_mod
from tserve.training.bpe import encode_batch, train_lm_tokenizer
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
from tserve.training.loop import LoopConfig, train_loop

SOURCES = ["shakespeare", "austen", "fortunes"]


@dataclass
class LMPreset:
    model: dict[str, Any]
    vocab_size: int = 4096
    context: int = 256
    batch_size: int = 16  # windows per step
    steps: int = 2000
    loop: LoopConfig = field(default_factory=LoopConfig)
    val_windows: int = 64


def preset(name: str) -> LMPreset:
    if name == "cpu":
        return LMPreset(
            model=dict(d_model=256, n_heads=4, d_ff=1024, n_layers=4), vocab_size=4096, context=256,
            batch_size=8, steps=1300,
            loop=LoopConfig(lr=1.5e-3, warmup_steps=100, weight_decay=0.1, betas=(0.9, 0.95), eval_every=250,
                            log_every=25),
        )
    if name == "gpu":
        return LMPreset(
            model=dict(d_model=512, n_heads=8, d_ff=2048, n_layers=8, dropout=0.1), vocab_size=8192, context=512,
            batch_size=64, steps=20000,
            loop=LoopConfig(lr=6e-4, warmup_steps=1000, weight_decay=0.1, betas=(0.9, 0.95), eval_every=1000,
                            log_every=100),
            val_windows=256,
        )
    raise ValueError(f"unknown preset {name!r}; expected cpu or gpu")


def token_stream(tokenizer: HFTokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one int32 stream, each followed by the end-of-text id."""
    eot = tokenizer.eos_id
    assert eot is not None
    ids = encode_batch(tokenizer, texts)
    out = np.empty(sum(len(x) + 1 for x in ids), dtype=np.int32)
    pos = 0
    for x in ids:
        out[pos : pos + len(x)] = x
        out[pos + len(x)] = eot
        pos += len(x) + 1
    return out


def window_batches(stream: np.ndarray, context: int, batch_size: int, g: torch.Generator) -> Iterator[Tensor]:
    """Endless batches (B, context + 1) of random windows."""
    data = torch.from_numpy(stream.astype(np.int64))
    span = len(data) - context - 1
    if span <= 0:
        raise ValueError(f"training text too short ({len(data)} tokens) for context {context}")
    offsets = torch.arange(context + 1)
    while True:
        starts = torch.randint(0, span + 1, (batch_size,), generator=g)
        yield data[starts[:, None] + offsets]


def eval_windows(stream: np.ndarray, context: int, limit: int | None = None) -> Tensor:
    """Consecutive non-overlapping windows (N, context + 1) covering the stream (last partial one dropped
    unless it is the only one)."""
    data = torch.from_numpy(stream.astype(np.int64))
    n = max(1, (len(data) - 1) // context)
    rows = [data[i * context : i * context + context + 1] for i in range(n)]
    rows = [r for r in rows if len(r) == context + 1] or [data[: context + 1]]
    if limit is not None:
        rows = rows[:limit]
    width = max(len(r) for r in rows)
    return torch.stack([F.pad(r, (0, width - len(r)), value=-100) for r in rows])


@torch.no_grad()
def mean_nll(model: Decoder, windows: Tensor, batch_size: int = 16) -> tuple[float, int]:
    """Mean next-token negative log-likelihood (nats) over all target positions, and their count."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        inp, tgt = w[:, :-1].clamp(min=0), w[:, 1:]
        logits = model(inp).float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=-100,
                                       reduction="sum"))
        count += int((tgt != -100).sum())
    return total / max(1, count), count


def strided_windows(stream: np.ndarray, context: int, stride: int | None = None) -> tuple[Tensor, Tensor]:
    """Overlapping evaluation windows: inputs and targets (N, context). Each window starts `stride` tokens
    after the previous one; targets already scored by an earlier window (and padding) are -100, so every
    token is predicted exactly once, all but the first `context - stride` with at least that much history
    (a fairer perplexity than disjoint windows, whose first tokens have no context at all)."""
    stride = stride or max(1, context // 2)
    data = torch.from_numpy(stream.astype(np.int64))
    inputs, targets = [], []
    done, start = 0, 0  # targets at stream positions 1..done are scored
    while done < len(data) - 1:
        window = data[start : start + context + 1]
        m = len(window) - 1
        inp = torch.zeros(context, dtype=torch.long)
        tgt = torch.full((context,), -100, dtype=torch.long)
        inp[:m], tgt[:m] = window[:-1], window[1:]
        tgt[: max(0, done - start)] = -100
        inputs.append(inp)
        targets.append(tgt)
        done, start = start + m, start + stride
    if not inputs:
        return torch.zeros(0, context, dtype=torch.long), torch.zeros(0, context, dtype=torch.long)
    return torch.stack(inputs), torch.stack(targets)


@torch.no_grad()
def strided_nll(model: Decoder, stream: np.ndarray, context: int, stride: int | None = None,
                batch_size: int = 16) -> tuple[float, int]:
    """Mean next-token NLL (nats) over the whole stream with sliding windows, and the number of tokens."""
    device = next(model.parameters()).device
    inputs, targets = strided_windows(stream, context, stride)
    total, count = 0.0, 0
    for i in range(0, len(inputs), batch_size):
        inp, tgt = inputs[i : i + batch_size].to(device), targets[i : i + batch_size].to(device)
        logits = model(inp).float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=-100,
                                       reduction="sum"))
        count += int((tgt != -100).sum())
    return total / max(1, count), count


@torch.no_grad()
def strided_top1_agreement(reference: Decoder, model: Decoder, stream: np.ndarray, context: int,
                           stride: int | None = None, batch_size: int = 16) -> tuple[float, int]:
    """Teacher-forced next-token agreement: over the same scored positions as `strided_nll`, the share where
    `model`'s most likely token is `reference`'s (a quantized model against its float32 weights), and the count."""
    device = next(reference.parameters()).device
    inputs, targets = strided_windows(stream, context, stride)
    same, count = 0, 0
    for i in range(0, len(inputs), batch_size):
        inp, scored = inputs[i : i + batch_size].to(device), targets[i : i + batch_size].to(device) != -100
        same += int((reference(inp).argmax(-1) == model(inp).argmax(-1))[scored].sum())
        count += int(scored.sum())
    return same / max(1, count), count


def lm_loss(model: Decoder, batch: Tensor, device: torch.device) -> tuple[Tensor, int]:
    batch = batch.to(device, non_blocking=True)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    return loss, batch[:, 1:].numel()


def train(opts: RunOptions, *, corpus: dict[str, list[str]] | None = None, config: LMPreset | None = None) -> Path:
    """Train the LM (tokenizer first) and save checkpoint + card to `opts.out`."""
    configure_threads()
    device = resolve_device(opts.device)
    p = config or preset(opts.preset)
    if opts.batch is not None:
        p = replace(p, batch_size=opts.batch)
    g = seed_everything(opts.seed)
    t0 = time.perf_counter()
    splits = corpus if corpus is not None else data_mod.load_lm_corpus(opts.data_root)
    train_texts, valid_texts, validated_on = validation_items(splits, lambda text: text)
    init = load_init(opts, "decoder")
    tokenizer = init.tokenizer if init is not None else train_lm_tokenizer(train_texts, vocab_size=p.vocab_size)
    train_stream = token_stream(tokenizer, train_texts)
    valid_stream = token_stream(tokenizer, valid_texts)
    val = eval_windows(valid_stream, p.context, p.val_windows)
    log_event("data_ready", train_tokens=len(train_stream), valid_tokens=len(valid_stream),
              vocab=tokenizer.vocab_size, seconds=round(time.perf_counter() - t0, 1))

    eot = tokenizer.eos_id
    cfg = DecoderConfig(vocab_size=tokenizer.vocab_size, max_seq_len=p.context, bos_token_id=eot, eos_token_id=eot,
                        pad_token_id=eot, **p.model)
    model = Decoder(cfg) if init is None else init.model.train()
    set_dropout(model, opts.dropout)
    cfg = model.cfg
    loop = LoopConfig(**{**asdict(p.loop), "betas": tuple(p.loop.betas)})
    tokens_per_step = p.batch_size * p.context
    plan_loop(loop, opts, p.steps, None, len(train_stream), tokens_per_step)
    out = Path(opts.out)
    generation = GenerationDefaults(num_beams=1, max_new_tokens=128)
    info: dict[str, Any] = {
        "task": "lm", "preset": opts.preset, "seed": opts.seed, "command": opts.command, "sources": SOURCES,
        "parameters": count_parameters(model), "hardware": hardware_description(device),
        "validated_on": validated_on,
        "data": {"train_chunks": len(train_texts), "train_tokens": int(len(train_stream)),
                 "valid_tokens": int(len(valid_stream)), "test_chunks": len(splits.get("test", []))},
        "hyperparameters": {"vocab_size": tokenizer.vocab_size, "context": p.context, "batch_size": p.batch_size,
                            "loop": asdict(loop)},
        "description": "Small GPT-style English language model trained from scratch (byte-level BPE).",
    }
    record_init(info, opts)

    def validate(m: Decoder) -> dict[str, float]:
        nll, _ = mean_nll(m, val)
        return {"val_loss": nll, "val_ppl": float(np.exp(nll))}

    def save(m: Decoder, step: int) -> None:
        save_checkpoint(out, m, tokenizer=tokenizer, generation=generation)

    result = train_loop(model, window_batches(train_stream, p.context, p.batch_size, g),
                        lambda m, b: lm_loss(m, b, device), loop, device=device, unit="tok",
                        validate=validate, save=save, desc="lm",
                        start_checkpoint=init is not None)
    info.update(steps=result.steps, kept_step=result.kept_step, seconds=round(result.seconds, 1), final_loss=round(result.final_loss, 4),
                stopped_early=result.stopped_early, validation=result.validations, history=result.history,
                tokens_seen=result.units)
    record_run(out, info)
    log_event("run_done", path=str(out), kept_step=result.kept_step)
    return out
