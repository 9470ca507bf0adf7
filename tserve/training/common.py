"""Small pieces every trainer needs: seeding, device choice, hardware description, structured logs.

Kept apart from the loop so that evaluation and the command line can use them without importing
training code.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tserve.training.data.sources import T
from tserve.training.data.splits import hash_bucket, normalise_key

log = logging.getLogger("tserve.training")
HELD_OUT_FRAC = 0.05  # of the distinct training texts, validated on when a data set has no validation split


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch (all devices) and return a CPU generator for data order/augmentation,
    so that two runs with the same seed and device see the same batches."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def resolve_device(spec: str | None) -> torch.device:
    """`auto` (CUDA when present), `cpu`, `cuda` or `cuda:N`; asking for absent CUDA is an error."""
    if spec in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec} asked for, but CUDA is not available here")
    return device


def configure_threads() -> int:
    """Honour OMP_NUM_THREADS for torch's intra-op pool (torch ignores it when set after import)."""
    n = os.environ.get("OMP_NUM_THREADS")
    if n and n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()


def hardware_description(device: torch.device) -> str:
    """One line for the model card: GPU name, or CPU model and the number of threads torch used."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"CPU {cpu_name()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo's `flags`, or `Features` on Arm; empty where it
    has none)."""
    try:
        return set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith(("flags", "Features"))).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def cpu_isa() -> str:
    """The CPU's vector extensions that pick kernels (AVX2, AVX-512 and its VNNI / BF16, AMX), and the ISA
    PyTorch's own kernels run at, which says when a run is held to AVX2 (`ATEN_CPU_CAPABILITY`)."""
    flags = cpu_flags()
    names = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "AVX512-BF16",
             "amx_tile": "AMX", "asimd": "NEON", "sve": "SVE"}
    present = [name for flag, name in names.items() if flag in flags] or ["no AVX2"]
    running = torch.backends.cpu.get_cpu_capability()
    return f"{', '.join(present)}; PyTorch kernels at {running}"


def cpu_description() -> str:
    """The CPU's name and ISA, as every benchmark table names its machine."""
    return f"{cpu_name()} ({cpu_isa()})"


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings count once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def log_event(event: str, **fields: Any) -> None:
    """A structured log record: the message is the event name, the fields travel as `extra` (for JSON
    handlers) and are appended as JSON for plain text handlers."""
    extra = {("field_" + k if k in _STANDARD_RECORD_FIELDS else k): v for k, v in fields.items()}
    log.info("%s %s", event, json.dumps(fields, default=str, sort_keys=True), extra={"event": event, **extra})


class JsonLinesHandler(logging.Handler):
    """Writes one JSON object per record (training logs under the output directory are machine-readable)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, record: logging.LogRecord) -> None:
        row = {"time": round(time.time(), 3), "level": record.levelname, "event": getattr(record, "event", None)}
        if row["event"] is None:
            row["message"] = record.getMessage()
        for k, v in record.__dict__.items():
            if k not in _STANDARD_RECORD_FIELDS and k not in row:
                row[k] = v
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")


_STANDARD_RECORD_FIELDS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def setup_logging(log_file: str | Path | None = None) -> None:
    """Console logs for people (when nothing else configured logging) plus an optional JSON-lines file."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    if log_file is not None:
        for h in list(log.handlers):
            if isinstance(h, JsonLinesHandler):
                log.removeHandler(h)
        log.addHandler(JsonLinesHandler(log_file))


def batches_per_epoch(n: int, batch_size: int) -> int:
    return max(1, n // batch_size)


@dataclass
class RunOptions:
    """What the command line (or a test) asks of a trainer; None means "the preset decides"."""

    out: Path
    device: str = "auto"
    preset: str = "cpu"
    steps: int | None = None
    epochs: float | None = None
    seed: int = 0
    max_minutes: float | None = None
    dataset: str | None = None
    command: str | None = None
    data_root: str | None = None
    progress: bool = True
    init_from: str | None = None  # continue from this checkpoint's weights (and tokenizer): fresh optimiser
    lr: float | None = None  # peak learning rate (overrides the preset; lower it to fine-tune with --init-from)
    direction: str | None = None  # translation: "en-de" or "de-en"; None: --init-from's, else en-de
    dropout: float | None = None  # dropout for this run (new or continued model); None: the preset's / checkpoint's
    batch: int | None = None  # examples per step (tokens, windows or images, as the task counts); None: the preset's


def load_init(opts: RunOptions, architecture: str):
    """The checkpoint `opts.init_from` in float32 on CPU, checked to be of `architecture` (or None)."""
    if not opts.init_from:
        return None
    from tserve.model.checkpoint import load  # noqa: PLC0415

    loaded = load(opts.init_from, device="cpu", dtype="float32")
    if loaded.config.architecture != architecture:
        raise ValueError(f"{opts.init_from} is a {loaded.config.architecture} checkpoint, not {architecture}")
    log_event("init_from", path=str(opts.init_from), parameters=count_parameters(loaded.model))
    return loaded


def set_dropout(model: torch.nn.Module, p: float | None) -> torch.nn.Module:
    """Every dropout of `model` (residual, MLP, embedding and attention probabilities) set to `p`, and its
    config to match: regularisation for a long run, also on a checkpoint trained without it. None: unchanged."""
    if p is None:
        return model
    from tserve.model.attention import Attention  # noqa: PLC0415

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
        elif isinstance(module, Attention):
            module.dropout = p
    if hasattr(model, "cfg"):
        model.cfg.dropout = p
    return model


def planned_steps(opts: RunOptions, preset_steps: int | None, preset_epochs: float | None, n_train: int,
                  batch_size: int) -> int:
    """--steps wins over --epochs, which wins over the preset (steps, else epochs)."""
    if opts.steps is not None:
        return max(1, opts.steps)
    epochs = opts.epochs if opts.epochs is not None else preset_epochs
    if epochs is not None:
        return max(1, round(epochs * n_train / batch_size))
    return max(1, preset_steps or 1)


def plan_loop(loop: Any, opts: RunOptions, preset_steps: int | None, preset_epochs: float | None, n_train: int,
              batch_size: int) -> Any:
    """Fill a trainer's LoopConfig from the command line: steps (see `planned_steps`), wall-time limit, peak
    learning rate, and warm-up / evaluation intervals that fit a short run."""
    loop.steps = planned_steps(opts, preset_steps, preset_epochs, n_train, batch_size)
    loop.max_minutes = opts.max_minutes if opts.max_minutes is not None else loop.max_minutes
    loop.lr = opts.lr if opts.lr is not None else loop.lr
    loop.warmup_steps = min(loop.warmup_steps, max(1, loop.steps // 10))
    loop.eval_every = min(loop.eval_every, loop.steps)
    return loop


def record_init(info: dict, opts: RunOptions) -> None:
    """Note in training.json that (and from what) training continued, with the earlier run's record."""
    if not opts.init_from:
        return
    earlier = Path(opts.init_from) / "training.json"
    info["continued_from"] = {"path": str(opts.init_from)}
    if earlier.is_file():
        prev = json.loads(earlier.read_text(encoding="utf-8"))
        info["continued_from"].update({k: prev.get(k) for k in ("command", "steps", "seconds", "final_loss")})
        if prev.get("continued_from"):  # keep the whole lineage, not just the last run
            info["continued_from"]["continued_from"] = prev["continued_from"]


def validation_items(splits: dict[str, list[T]], key: Callable[[T], str]) -> tuple[list[T], list[T], str]:
    """A run's training items, its validation items and what those are: "valid" (the data set's validation
    split), "held-out" (without one: HELD_OUT_FRAC of the distinct training texts, at least one, those whose hash
    is lowest, so that equal texts stay on one side as in the data sets' own splits) or "train" (training items of
    a single text, which can spare none: the validation figures are training figures). Logged as
    `validation_data`, recorded as training.json's `validated_on`."""
    train, valid, validated_on = splits["train"], splits.get("valid") or [], "valid"
    if not valid:
        keys = sorted({normalise_key(key(item)) for item in train}, key=hash_bucket)
        held = set(keys[: max(1, round(HELD_OUT_FRAC * len(keys)))]) if len(keys) > 1 else set()
        valid = [item for item in train if normalise_key(key(item)) in held] if held else train
        train = [item for item in train if normalise_key(key(item)) not in held]
        validated_on = "held-out" if held else "train"
    log_event("validation_data", validated_on=validated_on, train_items=len(train), valid_items=len(valid))
    return train, valid, validated_on
