"""A generic training loop shared by the translation, LM and ViT trainers.

The task supplies an endless iterator of batches and a loss function returning (loss, units), where
units are tokens or images (for the throughput display); the loop owns everything else: AdamW with
decoupled weight decay on matrices only, warmup + cosine or Vaswani learning-rate schedule, gradient
clipping, mixed precision on CUDA (bf16, fp16 with a scaler where bf16 is unsupported), periodic
validation, checkpoints of the best validated weights, a time budget, a tqdm bar and structured logs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from tserve.training.common import log_event

Schedule = Literal["cosine", "vaswani", "constant"]


@dataclass
class LoopConfig:
    """Optimisation settings. `steps` is the planned length (the schedule depends on it); the loop may
    stop earlier when `max_minutes` runs out."""

    steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.05  # cosine floor as a share of lr
    warmup_steps: int = 100
    schedule: Schedule = "cosine"
    d_model: int = 256  # for the Vaswani schedule
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    eval_every: int = 500
    checkpoint_every: int = 0  # without validation: save every this many steps; with it, only improvements are saved
    log_every: int = 50
    max_minutes: float | None = None
    amp: bool = True  # only takes effect on CUDA


def learning_rate(cfg: LoopConfig, step: int, time_fraction: float = 0.0) -> float:
    """Learning rate for optimiser step `step` (0-based). `time_fraction` (elapsed / time budget) moves the
    cosine decay forward when the budget, not the step count, will end the run: a run cut short by
    `max_minutes` (a slower or busier machine) still finishes with an annealed learning rate."""
    s = step + 1
    if cfg.schedule == "vaswani":
        # lr * min(s^-0.5, s * warmup^-1.5), normalised so that the peak equals cfg.lr.
        w = max(1, cfg.warmup_steps)
        return cfg.lr * min(s**-0.5, s * w**-1.5) * math.sqrt(w)
    if s <= cfg.warmup_steps:
        return cfg.lr * s / max(1, cfg.warmup_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, max((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), time_fraction))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, cfg: LoopConfig) -> torch.optim.AdamW:
    """AdamW; norms, biases, embeddings of positions and class tokens (1-D or tiny) get no decay."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and not any(t in name for t in ("pos_emb", "cls_token", "dist_token")) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused or None)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    units: int
    final_loss: float
    history: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    kept_step: int | None = None  # the validated step whose weights `save` last wrote (the best so far)
    kept_value: float | None = None  # its `best_metric`


LossFn = Callable[[nn.Module, Any], tuple[Tensor, int]]


def autocast_context(device: torch.device, enabled: bool) -> tuple[contextlib.AbstractContextManager, bool]:
    """bf16 autocast on CUDA where supported (no scaler needed), fp16 + GradScaler otherwise; nothing on CPU
    (CPU bf16 matmuls are slow on most machines and would make results depend on the hardware)."""
    if device.type != "cuda" or not enabled:
        return contextlib.nullcontext(), False
    if torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16), False
    return torch.autocast("cuda", dtype=torch.float16), True


def train_loop(
    model: nn.Module,
    batches: Iterator[Any],
    loss_fn: LossFn,
    cfg: LoopConfig,
    *,
    device: torch.device,
    unit: str = "tok",
    validate: Callable[[nn.Module], dict[str, float]] | None = None,
    save: Callable[[nn.Module, int], None] | None = None,
    desc: str = "train",
    best_metric: str = "val_loss",
    higher_is_better: bool = False,
    start_checkpoint: bool = False,
) -> TrainResult:
    """Run `cfg.steps` optimiser steps (or until `cfg.max_minutes`). `validate(model)` returns metrics
    (the model is put in eval mode around it); `save(model, step)` writes a checkpoint. With `validate`, a
    checkpoint is written at the first validation and then only when `best_metric` beats every earlier one,
    so a long run that starts to overfit leaves its best weights on disk, not its last; the run always
    validates its final step. `start_checkpoint` (continued training): the starting weights are validated
    and written first (step 0), so a run that only gets worse leaves them as they were. Without `validate`,
    `save` runs every `cfg.checkpoint_every` steps and at the end."""
    model.to(device).train()
    opt = make_optimizer(model, cfg)
    ctx, use_scaler = autocast_context(device, cfg.amp)
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    start = time.perf_counter()
    deadline = start + cfg.max_minutes * 60 if cfg.max_minutes else None
    result = TrainResult(steps=0, seconds=0.0, units=0, final_loss=float("nan"))
    ema: float | None = None
    window_units, window_start = 0, time.perf_counter()
    rate = 0.0
    bar = tqdm(total=cfg.steps, desc=desc, unit="step", dynamic_ncols=True, mininterval=2.0, disable=None)
    log_event("train_start", steps=cfg.steps, lr=cfg.lr, schedule=cfg.schedule, device=str(device))
    if validate is not None and save is not None and start_checkpoint:
        _validate(model, validate, 0, result)
        _keep_if_best(model, save, result, 0, best_metric, higher_is_better)
    step, saved_at = 0, -1
    for step in range(cfg.steps):
        time_fraction = (time.perf_counter() - start) / (cfg.max_minutes * 60) if cfg.max_minutes else 0.0
        lr = learning_rate(cfg, step, time_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next(batches)
        with ctx:
            loss, units = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value} at step {step}")
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        result.units += units
        window_units += units
        now = time.perf_counter()
        if now - window_start >= 2.0:
            rate, window_units, window_start = window_units / (now - window_start), 0, now
        bar.update(1)
        bar.set_postfix_str(f"loss {ema:.3f} lr {lr:.2e} {rate:,.0f} {unit}/s", refresh=False)
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            row = {"step": done, "loss": round(ema, 4), "lr": lr, f"{unit}_per_s": round(rate, 1),
                   "elapsed_s": round(now - start, 1)}
            if grad_norm is not None:
                row["grad_norm"] = round(float(grad_norm), 3)
            result.history.append(row)
            log_event("train_step", **row)
        out_of_time = deadline is not None and now >= deadline
        if validate is not None and (done % cfg.eval_every == 0 or done == cfg.steps or out_of_time):
            _validate(model, validate, done, result)
            if save is not None:
                _keep_if_best(model, save, result, done, best_metric, higher_is_better)
        elif save is not None and validate is None and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            save(model, done)
            saved_at = done
        if out_of_time:
            result.stopped_early = done < cfg.steps
            log_event("time_budget_reached", step=done, minutes=cfg.max_minutes)
            break
    bar.close()
    result.steps = step + 1 if cfg.steps else 0
    if validate is None and save is not None and saved_at != result.steps:
        save(model, result.steps)
    result.seconds = time.perf_counter() - start
    result.final_loss = float(ema) if ema is not None else float("nan")
    model.eval()
    log_event("train_end", steps=result.steps, seconds=round(result.seconds, 1), loss=result.final_loss)
    return result


def _keep_if_best(model: nn.Module, save: Callable[[nn.Module, int], None], result: TrainResult, step: int,
                  metric: str, higher_is_better: bool) -> None:
    """Save the newest validation's weights if its `metric` beats the kept one's (the first is always kept; a NaN
    beats nothing, and is beaten by any number)."""
    value, kept = result.validations[-1][metric], result.kept_value
    if kept is not None and not math.isnan(kept) and (math.isnan(value) or not (
            value > kept if higher_is_better else value < kept)):
        return
    save(model, step)
    result.kept_step, result.kept_value = step, value
    log_event("checkpoint_kept", step=step, **{metric: value})


def _validate(model: nn.Module, validate: Callable[[nn.Module], dict[str, float]], step: int,
              result: TrainResult) -> None:
    model.eval()
    with torch.no_grad():
        metrics = validate(model)
    model.train()
    row = {"step": step, **{k: round(float(v), 5) for k, v in metrics.items()}}
    result.validations.append(row)
    log_event("validation", **row)
    tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
