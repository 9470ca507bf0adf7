"""Taking in the weights a GPU lease trained (`bash bench/gpu_session.sh lease` or `train`): each candidate is
evaluated on this machine against the bundled model it continued from, and installed only when it is better.

    python -m tserve.training.adopt RETURNED [--models models] [--limit N] [--no-install]

RETURNED is the lease's $OUT as it came back: `en-de.safetensors`, `de-en.safetensors`, `lm.safetensors` (any of
them) and the trainings' records, `train-records.tar.gz` or inside `results.tar.gz`. A candidate checkpoint is the
bundled directory (tokenizer, generation defaults) with the run's config.json, training.json and train_log.jsonl
and its weights. Better means:

- translators: a higher BLEU on the test split and a chrF on the Ding example sentences (the short everyday
  sentences of the test split) no lower than the bundled model's;
- LM: a lower perplexity on its test split.

Both sides are evaluated in float32 on the CPU (`tserve.training.evaluate`), on the same items (all of the test
split, or the first `--limit`): stored figures could come from other code or data. The chrF rule reads the Ding
sentences among those items: when they hold none (a small `--limit`), the rule cannot be applied, and the verdict
says so (the printed table's "not judged by" column, the log and the installed card's note). An installed
candidate brings its metrics.json and a card (MODEL_CARD.md) that names the GPU it was trained on and the figures
it replaced; the int8 / int4 figures of the old weights are dropped (run
`python -m tserve.training eval models/NAME --quantize int8` and `--quantize int4` again).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from tserve.training.card import METRICS_FILE, TRAINING_FILE, read_json, write_card, write_json

NAMES = ("en-de", "de-en", "lm")
RUN_FILES = ("config.json", TRAINING_FILE, "train_log.jsonl")  # what a run's records add to the bundled directory
INSTALLED = ("model.safetensors", *RUN_FILES, METRICS_FILE)


def figures(metrics: dict[str, Any]) -> dict[str, float | None]:
    """The figures a candidate is judged by: (test BLEU, Ding sentences' chrF) or (test perplexity)."""
    if "perplexity" in metrics:
        return {"perplexity": metrics["perplexity"]}
    return {"bleu": metrics.get("bleu"), "ding_chrf": (metrics.get("ding_sentences") or {}).get("chrf")}


RULES = {"bleu": "test BLEU", "ding_chrf": "the Ding sentences' chrF", "perplexity": "test perplexity"}


def unjudged(new: dict[str, float | None], old: dict[str, float | None], limit: int | None) -> dict[str, str]:
    """The rules `is_better` could not apply (a figure missing on either side), each with why."""
    items = "the test split" if limit is None else f"the first {limit} test items"
    missing = {"ding_chrf": f"no Ding example sentence among {items}"}
    return {RULES[k]: missing.get(k, f"no figure on {items}") for k in new if new[k] is None or old[k] is None}


def is_better(new: dict[str, float | None], old: dict[str, float | None]) -> bool:
    if "perplexity" in new:
        return new["perplexity"] < old["perplexity"]
    if new["bleu"] is None or old["bleu"] is None or new["bleu"] <= old["bleu"]:
        return False
    return new["ding_chrf"] is None or old["ding_chrf"] is None or new["ding_chrf"] >= old["ding_chrf"]


def run_records(returned: Path) -> dict[str, bytes]:
    """The trainings' records (`NAME/file` -> bytes): train-records.tar.gz, alone or inside results.tar.gz."""
    def members(archive: tarfile.TarFile) -> dict[str, bytes]:
        return {m.name.removeprefix("./"): archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}

    if (returned / "train-records.tar.gz").is_file():
        with tarfile.open(returned / "train-records.tar.gz") as archive:
            return members(archive)
    if (returned / "results.tar.gz").is_file():
        with tarfile.open(returned / "results.tar.gz") as results:
            inner = members(results).get("train-records.tar.gz")
        if inner is not None:
            with tarfile.open(fileobj=io.BytesIO(inner)) as archive:
                return members(archive)
    raise FileNotFoundError(f"no train-records.tar.gz in {returned}, alone or in results.tar.gz")


def candidate_dir(bundled: Path, weights: Path, records: dict[str, bytes], name: str, into: Path) -> Path:
    d = into / bundled.name
    shutil.copytree(bundled, d)
    (d / METRICS_FILE).unlink(missing_ok=True)
    for file in RUN_FILES:
        if f"{name}/{file}" in records:
            (d / file).write_bytes(records[f"{name}/{file}"])
    shutil.copyfile(weights, d / "model.safetensors")
    return d


def _evaluate(path: Path, limit: int | None, data_root: str | None, write: bool) -> dict[str, Any]:
    from tserve.training.evaluate import evaluate_checkpoint  # noqa: PLC0415 - torch and the data sets, on use

    return evaluate_checkpoint(path, limit=limit, device="cpu", data_root=data_root, write=write)


def _judged_figures(path: Path, limit: int | None, data_root: str | None) -> dict[str, Any]:
    """The bundled model's side: only what `figures` reads (no samples, no n-gram baselines, no reference slice)."""
    from tserve.model.checkpoint import load  # noqa: PLC0415
    from tserve.training.evaluate import evaluate_loaded, task_of  # noqa: PLC0415

    loaded = load(path, device="cpu", dtype="float32")
    return evaluate_loaded(loaded, path, limit=limit, data_root=data_root, full=task_of(loaded) == "translation")


def adopt(returned: str | Path, models: str | Path = "models", *, limit: int | None = None,
          data_root: str | None = None, install: bool = True) -> list[dict[str, Any]]:
    """Evaluate each returned candidate against its bundled model and install the better ones; one row each."""
    from tserve.training.common import log_event  # noqa: PLC0415 - torch, as the evaluation needs it anyway

    returned, models = Path(returned), Path(models)
    records = run_records(returned)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            weights = returned / f"{name}.safetensors"
            if not weights.is_file():
                continue
            bundled = models / f"tserve-{name}"
            old = figures(_judged_figures(bundled, limit, data_root))  # same code, same data, same machine
            cand = candidate_dir(bundled, weights, records, name, Path(tmp))
            new = figures(_evaluate(cand, limit, data_root, write=limit is None))
            hardware = read_json(cand / TRAINING_FILE).get("hardware")
            better = is_better(new, old)
            row = {"model": bundled.name, "old": old, "new": new, "hardware": hardware,
                   "not_judged_by": unjudged(new, old, limit), "better": better, "installed": better and install}
            if row["installed"]:
                _install(cand, bundled, old, new, hardware, limit, row["not_judged_by"])
            log_event("adoption", limit=limit, **row)
            rows.append(row)
    return rows


def _install(cand: Path, bundled: Path, old: dict, new: dict, hardware: str | None, limit: int | None,
             not_judged_by: dict[str, str]) -> None:
    info = read_json(cand / TRAINING_FILE)
    change = ", ".join(f"{k} {old[k]} → {new[k]}" for k in new)
    items = "the whole test split" if limit is None else f"the first {limit} test items"
    note = (f"Trained on {hardware or 'a GPU'}; installed on {datetime.date.today().isoformat()} after a float32 "
            f"evaluation on the CPU of {items} against the weights it continued from: {change}.")
    note += "".join(f" Not judged by {rule}: {why}." for rule, why in not_judged_by.items())
    info["notes"] = f"{info['notes']}\n\n{note}" if info.get("notes") else note
    write_json(cand / TRAINING_FILE, info)
    if limit is not None:  # figures of a slice describe no model: the card says to evaluate it in full
        (cand / METRICS_FILE).unlink(missing_ok=True)
    for file in INSTALLED:
        if (cand / file).is_file():
            shutil.copyfile(cand / file, bundled / file)
        else:
            (bundled / file).unlink(missing_ok=True)
    write_card(bundled)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tserve.training.adopt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("returned", help="the lease's $OUT: NAME.safetensors files and the trainings' records")
    ap.add_argument("--models", default="models", help="where the bundled models are (default models/)")
    ap.add_argument("--limit", type=int, default=None, help="evaluate both on the first N test items only (a translator's chrF rule: on the "
                    "Ding sentences among them; with none, the verdict says it is not applied)")
    ap.add_argument("--data-dir", default=None, help="data cache (default data/ or $TSERVE_DATA_DIR)")
    ap.add_argument("--no-install", action="store_true", help="compare only")
    args = ap.parse_args(argv)
    try:
        rows = adopt(args.returned, args.models, limit=args.limit, data_root=args.data_dir,
                     install=not args.no_install)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("| model | bundled | candidate | trained on | not judged by | better | installed |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        waived = "; ".join(f"{rule} ({why})" for rule, why in r["not_judged_by"].items()) or "-"
        print(f"| {r['model']} | {json.dumps(r['old'])} | {json.dumps(r['new'])} | {r['hardware']} | {waived} | "
              f"{r['better']} | {r['installed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
