"""Model cards: `MODEL_CARD.md` rendered from `training.json` (written by the trainers) and
`metrics.json` (written by evaluation), so the card can be regenerated whenever either changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tserve.training.data import SOURCES
from tserve.training.data.pairs import LANGUAGE_NAMES

TRAINING_FILE = "training.json"
METRICS_FILE = "metrics.json"
CARD_FILE = "MODEL_CARD.md"

TASK_TITLES = {
    "translation": "{source} → {target} translation (encoder-decoder transformer)",
    "lm": "English language model (decoder-only transformer)",
    "vit": "Image classifier (Vision Transformer)",
}
# training.json's `validated_on` (tserve.training.common.validation_items): what the validation figures are of
VALIDATED_ON = {
    "valid": "the data set's validation split",
    "held-out": "training items held out of training (the data set has no validation split)",
    "train": "the training data itself (no validation split, and a single training text, none to spare): the "
             "validation figures are training figures",
}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower() if isinstance(v, bool) else "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            rows.extend(_flatten(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            rows.append((f"{prefix}{k}", v))
    return rows


def render_card(directory: str | Path) -> str:
    """The card text for a checkpoint directory (missing pieces are left out, not invented)."""
    d = Path(directory)
    info = read_json(d / TRAINING_FILE)
    metrics = read_json(d / METRICS_FILE)
    config = read_json(d / "config.json")
    task = info.get("task", "?")
    source, target = (LANGUAGE_NAMES.get(config.get(k), config.get(k)) for k in ("source_lang", "target_lang"))
    title = TASK_TITLES.get(task, task).format(source=source or "English", target=target or "German")
    lines = [f"# {d.name}", "", title, ""]
    if info.get("description"):
        lines += [info["description"], ""]
    lines += ["## Model", "", "| | |", "|---|---|"]
    lines.append(f"| architecture | {config.get('architecture', '?')} |")
    if "parameters" in info:
        lines.append(f"| parameters | {info['parameters']:,} |")
    weights = d / "model.safetensors"
    if weights.is_file():
        lines.append(f"| weights | model.safetensors, {weights.stat().st_size / 1e6:.1f} MB ({_stored_dtype(weights)}) |")
    keys = ("d_model", "n_heads", "d_ff", "n_layers", "n_encoder_layers", "n_decoder_layers", "vocab_size",
            "max_seq_len", "max_source_len", "image_size", "patch_size", "n_classes", "positions", "norm",
            "activation", "dropout")
    for k in keys:
        if k in config:
            lines.append(f"| {k} | {config[k]} |")
    lines.append("")
    pre = read_json(d / "preprocessing.json")
    if pre:
        lines += ["## Input preprocessing", "",
                  "Every image (PNG/JPEG, any size, colour or grey, either polarity) is converted as recorded in "
                  "`preprocessing.json`: " + ", ".join(f"{k}={v}" for k, v in pre.items()) + ". With invert=auto a "
                  "light background is inverted (light object on black, as in the training data); autocontrast "
                  "maps the background to black; fit=content crops to the object and centres it.", ""]
    sources = info.get("sources", [])
    if sources:
        lines += ["## Training data", "", "| source | package | licence | description |", "|---|---|---|---|"]
        for name in sources:
            s = SOURCES.get(name)
            if s is not None:
                pkg = f"{s.kind}: `{s.package}`" + (f" {s.version}" if s.version else "")
                lines.append(f"| {s.name} | {pkg} | {s.license} | {s.description} |")
        lines.append("")
        if info.get("data"):
            lines += ["Split sizes: " + ", ".join(f"{k} {_fmt(v)}" for k, v in info["data"].items()), ""]
        lines += ["Data are fetched and split reproducibly by `tserve/training/data/` (splits by hash; the test "
                  "split is never used for training or model selection).", ""]
    lines += ["## Training", ""]
    if info.get("command"):
        lines += ["```", info["command"], "```", ""]
    chain, earlier = [], info.get("continued_from")
    while earlier:
        chain.append(earlier)
        earlier = earlier.get("continued_from")
    if chain:
        total = (info.get("seconds") or 0) + sum(e.get("seconds") or 0 for e in chain)
        lines += [f"Training continued from {len(chain)} earlier run{'s' if len(chain) > 1 else ''} "
                  f"({total / 60:.1f} min in all, this one included); the figures below are those of the last "
                  "one. Earlier runs, oldest first:", ""]
        lines += [f"- `{e.get('command')}`: {_fmt(e.get('steps'))} steps, {(e.get('seconds') or 0) / 60:.1f} min"
                  for e in reversed(chain)] + [""]
    rows = [("preset", info.get("preset")), ("seed", info.get("seed")), ("steps", info.get("steps")),
            ("wall time", f"{info['seconds'] / 60:.1f} min" if "seconds" in info else None),
            ("hardware", info.get("hardware")), ("final training loss", info.get("final_loss")),
            ("stopped by time budget", info.get("stopped_early")),
            ("weights kept from step", info.get("kept_step"))]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows if v is not None] + [""]
    if info.get("hyperparameters"):
        lines += ["Hyperparameters: " + ", ".join(f"{k}={_fmt(v)}" for k, v in _flatten(info["hyperparameters"])), ""]
    if info.get("validated_on"):
        lines += [f"Validated on {VALIDATED_ON.get(info['validated_on'], info['validated_on'])}.", ""]
    if info.get("validation"):
        last = info["validation"][-1]
        lines += ["Last validation: " + ", ".join(f"{k} {_fmt(v)}" for k, v in last.items()), ""]
        kept = next((row for row in info["validation"] if row.get("step") == info.get("kept_step")), None)
        if kept is not None and kept is not last:  # the weights are those of the best validation, not the last
            lines += ["Best validation (the weights kept): " + ", ".join(f"{k} {_fmt(v)}" for k, v in kept.items()),
                      ""]
    lines += ["## Evaluation (held-out test split)", ""]
    if metrics:
        samples = metrics.get("samples")
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in _flatten({k: v for k, v in metrics.items() if k != "samples"})]
        lines.append("")
        if any(k.startswith("int8") for k in metrics):
            lines += ["`int8.*`: the same evaluation with `--quantize int8` and 8-bit activations, what a CPU with "
                      "VNNI or AMX runs, and one with AVX2 only on our exact kernel; `int8_split.*`: with split "
                      "activations (two 7-bit halves); `int8_7bit.*`: with 7-bit activations; `int8_7bit_weights.*`: with "
                      "8-bit activations on 7-bit weights (`--int8-activations`).", ""]
        if "int4" in metrics:
            lines += ["`int4.*`: the same evaluation with `--quantize int4` (group-wise int4 weights, 32 a group; a "
                      "text model's output (vocabulary) layer int8).", ""]
        if "q8_0" in metrics or "q4_0" in metrics:
            lines += ["`q8_0.*` / `q4_0.*`: the same evaluation with `--quantize q8_0` / `q4_0` (llama.cpp's block "
                      "formats, 32 weights a scale; under `q4_0` a text model's output layer Q8_0).", ""]
        if samples:
            lines += ["Samples:", ""]
            for s in samples:
                lines.append("- " + " → ".join(f"`{x}`" if i == 0 else str(x) for i, x in enumerate(s))
                             if isinstance(s, list) else f"- {s}")
            lines.append("")
    else:
        lines += ["Not evaluated yet: run `python -m tserve.training eval " + str(d) + "`.", ""]
    if info.get("notes"):
        lines += ["## Notes", "", info["notes"], ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def record_run(directory: str | Path, info: dict[str, Any]) -> Path:
    """A training run's end: its record (`training.json`) and the card. Test figures of weights the run replaced
    (a `metrics.json` already there, say from retraining into the same directory) go: they are not this run's,
    and `eval` writes the new ones."""
    directory = Path(directory)
    write_json(directory / TRAINING_FILE, info)
    (directory / METRICS_FILE).unlink(missing_ok=True)
    return write_card(directory)


def write_card(directory: str | Path) -> Path:
    path = Path(directory) / CARD_FILE
    path.write_text(render_card(directory), encoding="utf-8")
    return path


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _stored_dtype(weights: Path) -> str:
    """The dtype the weights are stored in (the first floating tensor's)."""
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(str(weights), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
            kind = f.get_slice(name).get_dtype()
            if kind in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[kind]
    return "float32"
