"""`train` and `eval` subcommands, registered on any argparse parser (the service's `tserve` command
and `python -m tserve.training` share them). Task modules are imported only when a command runs, so that
building the parser stays cheap."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

TASKS = ("translation", "lm", "vit")
DIRECTIONS = ("en-de", "de-en")
DEFAULT_OUT = {
    ("translation", "en-de"): "models/tserve-en-de",
    ("translation", "de-en"): "models/tserve-de-en",
    "lm": "models/tserve-lm",
    ("vit", "fashion-mnist"): "models/tserve-vit-fashion",
    ("vit", "mnist-digits"): "models/tserve-vit-digits",
    ("vit", "mnist-5k"): "runs/tserve-vit-digits-5k",
}
VIT_DATASETS = ("fashion-mnist", "mnist-digits", "mnist-5k")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `train` and `eval` to `subparsers`; each sets `func(namespace) -> int`."""
    t = subparsers.add_parser("train", help="train a bundled model (translation, lm, vit)",
                              description="Train a model from scratch on the packaged data sets.")
    t.add_argument("task", choices=TASKS)
    t.add_argument("--dataset", default=None, help="vit: fashion-mnist (default), mnist-digits (all of MNIST) or mnist-5k "
                                                         "(a 5,000-digit sample, for quick runs)")
    t.add_argument("--direction", default=None, choices=DIRECTIONS,
                   help="translation: en-de (default) or de-en, the same pairs read the other way")
    t.add_argument("--out", default=None, help="checkpoint directory (default models/<name>)")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    t.add_argument("--preset", default="cpu", choices=("cpu", "gpu"), help="model/schedule size")
    length = t.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help="optimiser steps (overrides the preset)")
    length.add_argument("--epochs", type=float, default=None, help="passes over the training data")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this wall time (a cosine schedule's decay fits it, the cpu presets'; the gpu "
                        "translation preset's inverse square root has no end to fit; the best validated weights stay)")
    t.add_argument("--data-dir", default=None, help="data cache (default data/ or $TSERVE_DATA_DIR)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    t.add_argument("--dropout", type=_probability, default=None, metavar="P",
                   help="dropout probability for this run, also on an --init-from checkpoint trained without it "
                        "(default: the preset's, or the checkpoint's)")
    t.add_argument("--batch", type=_positive_int, default=None, metavar="N",
                   help="examples per optimiser step (default: the preset's): translation, source + target tokens "
                        "(padding included); lm, windows of the context length; vit, images")
    t.add_argument("--init-from", default=None, metavar="DIR",
                   help="continue training from this checkpoint's weights (and tokenizer)")
    t.set_defaults(func=run_train)

    e = subparsers.add_parser("eval", help="evaluate a checkpoint on its held-out test split",
                              description="Compute test metrics, write metrics.json and update MODEL_CARD.md.")
    e.add_argument("checkpoint", help="checkpoint directory")
    e.add_argument("--limit", type=int, default=None, help="evaluate on the first N test items only")
    e.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    e.add_argument("--data-dir", default=None, help="data cache (default data/ or $TSERVE_DATA_DIR)")
    e.add_argument("--no-write", action="store_true", help="print metrics without writing them")
    e.add_argument("--quantize", default="none", choices=("none", "int8", "int4", "q8_0", "q4_0"),
                   help="int8 / int4 / q8_0 / q4_0: evaluate the quantized model (as served with that --quantize; a "
                        "language model also reports its next-token agreement with float32); stored beside the "
                        "float32 figures")
    e.add_argument("--int8-activations", default="auto", choices=("auto", "full", "split", "7bit", "7bit-weights"),
                   help="with --quantize int8: how activations are quantized (as `tserve serve --int8-activations`); "
                        "full and split figures are stored apart")
    e.set_defaults(func=run_eval)

    h = subparsers.add_parser("half", help="store checkpoints' float32 weights in float16",
                              description="Rewrite each checkpoint's model.safetensors with its float32 tensors in "
                                          "float16 (half the size; served in --dtype as before) and re-render its "
                                          "model card.")
    h.add_argument("checkpoint", nargs="+", help="checkpoint directory")
    h.set_defaults(func=run_half)

    from tserve.training.alignment import register as register_align  # noqa: PLC0415

    register_align(subparsers)


def inherited_direction(init_from: str | None) -> str | None:
    """The direction of the translator `--init-from` names ("de-en" for tserve-de-en), from its config.json."""
    config = Path(init_from or "") / "config.json"
    if not init_from or not config.is_file():
        return None
    import json  # noqa: PLC0415

    raw = json.loads(config.read_text())
    if raw.get("source_lang") and raw.get("target_lang"):
        return f"{raw['source_lang']}-{raw['target_lang']}"
    return None


def default_out(task: str, dataset: str | None, direction: str | None = None) -> str:
    if task == "vit":
        return DEFAULT_OUT[("vit", dataset or "fashion-mnist")]
    if task == "translation":
        return DEFAULT_OUT[("translation", direction or "en-de")]
    return DEFAULT_OUT[task]


def run_train(args: argparse.Namespace) -> int:
    from tserve.training.common import RunOptions, setup_logging  # noqa: PLC0415

    if args.task == "vit" and args.dataset not in (None, *VIT_DATASETS):
        print(f"unknown dataset {args.dataset!r} for vit: expected one of {', '.join(VIT_DATASETS)}", file=sys.stderr)
        return 2
    if args.task != "vit" and args.dataset is not None:
        print(f"--dataset applies to vit only; {args.task} has one data set", file=sys.stderr)
        return 2
    if args.task != "translation" and args.direction is not None:
        print(f"--direction applies to translation only, not {args.task}", file=sys.stderr)
        return 2
    direction = args.direction or (inherited_direction(args.init_from) if args.task == "translation" else None)
    if direction is not None and direction not in DIRECTIONS:
        print(f"--init-from {args.init_from} translates {direction}; the bundled data are {' or '.join(DIRECTIONS)}",
              file=sys.stderr)
        return 2
    out = Path(args.out or default_out(args.task, args.dataset, direction))
    out.mkdir(parents=True, exist_ok=True)
    setup_logging(out / "train_log.jsonl")
    opts = RunOptions(
        out=out, device=args.device, preset=args.preset, steps=args.steps, epochs=args.epochs, seed=args.seed,
        max_minutes=args.max_minutes, dataset=args.dataset, data_root=args.data_dir, init_from=args.init_from,
        lr=args.lr, direction=direction, batch=args.batch,
        dropout=args.dropout,
        command=" ".join(shlex.quote(a) for a in _command_line()),
    )
    try:
        if args.task == "vit":
            from tserve.training.vit import train  # noqa: PLC0415
        elif args.task == "lm":
            from tserve.training.lm import train  # noqa: PLC0415
        else:
            from tserve.training.translation import train  # noqa: PLC0415
        path = train(opts)
    except (ValueError, FileNotFoundError) as exc:
        logging.getLogger("tserve.training").error("training failed: %s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"saved {path}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from tserve.training.common import setup_logging  # noqa: PLC0415
    from tserve.training.evaluate import evaluate_checkpoint  # noqa: PLC0415

    setup_logging()
    try:
        metrics = evaluate_checkpoint(args.checkpoint, limit=args.limit, device=args.device,
                                      data_root=args.data_dir, write=not args.no_write, quantize=args.quantize,
                                      int8_activations=args.int8_activations)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    import json  # noqa: PLC0415

    print(json.dumps({k: v for k, v in metrics.items() if k != "samples"}, indent=2, ensure_ascii=False))
    return 0


def run_half(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    from tserve.model.importers.base import WeightSource  # noqa: PLC0415
    from tserve.training.card import write_card  # noqa: PLC0415

    failed = 0
    for checkpoint in args.checkpoint:
        try:
            files = WeightSource.files(Path(checkpoint))  # model.safetensors, or each shard its index names
            for path in files:
                with safe_open(str(path), "pt") as f:
                    metadata = f.metadata()
                    tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
                halved = {k: v.half() if v.dtype == torch.float32 else v for k, v in tensors.items()}
                save_file(halved, str(path), metadata=metadata)
                print(f"{path}: {sum(v.dtype == torch.float32 for v in tensors.values())} tensors now float16")
            write_card(checkpoint)
        except (ValueError, OSError, SafetensorError) as exc:  # the others given are still converted
            print(f"error: {checkpoint}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text}")
    return value


def _command_line() -> list[str]:
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0:1] = ["python", "-m", "tserve.training"]
    elif argv:
        argv[0] = Path(argv[0]).name
    return argv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tserve.training", description="Train and evaluate tserve models.")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
