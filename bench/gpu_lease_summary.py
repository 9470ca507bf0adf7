"""The summary table a GPU lease prints last (`bash bench/gpu_session.sh lease`): its reply carries only the end of
the output, so this is what must fit there. Read from the lease's results.tar.gz and the weights files beside it.

    python bench/gpu_lease_summary.py OUT      # OUT: the lease's $OUT
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

WEIGHTS = ("en-de", "de-en", "lm")
RETURN_LIMIT = 16 * 2**20  # the device tool brings back files up to 16 MiB


def _members(archive: tarfile.TarFile) -> dict[str, bytes]:
    return {m.name.removeprefix("./"): archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)


def summary(out: Path) -> list[str]:
    lines: list[str] = []
    results = out / "results.tar.gz"
    files = _members(tarfile.open(results)) if results.is_file() else {}
    lines.append(f"## lease summary ({out})")
    lines.append("| tests | passed | failed | errors | skipped |")
    lines.append("|---|---|---|---|---|")
    for name in ("gpu-tests.xml", "kernel-tests.xml"):
        if name not in files:
            lines.append(f"| {name} | no report | | | |")
            continue
        suites = ET.fromstring(files[name])
        suites = [suites] if suites.tag == "testsuite" else list(suites)
        tests, failures, errors, skipped = (sum(int(s.get(k, 0)) for s in suites)
                                            for k in ("tests", "failures", "errors", "skipped"))
        lines.append(f"| {name} | {tests - failures - errors - skipped} | {failures} | {errors} | {skipped} |")
    lines += ["", "| training | steps | kept step | best validation loss | weights back |", "|---|---|---|---|---|"]
    records = {}
    if "train-records.tar.gz" in files:
        records = _members(tarfile.open(fileobj=io.BytesIO(files["train-records.tar.gz"])))
    for name in WEIGHTS:
        info = json.loads(records.get(f"{name}/training.json", b"{}"))
        kept = next((r for r in info.get("validation", []) if r.get("step") == info.get("kept_step")), {})
        weights = out / f"{name}.safetensors"
        size = weights.stat().st_size if weights.is_file() else None
        back = "missing" if size is None else f"{size / 2**20:.1f} MiB" + (" TOO BIG" if size > RETURN_LIMIT else "")
        loss = kept.get("val_loss")
        lines.append(f"| {name} | {_fmt(info.get('steps'))} | {_fmt(info.get('kept_step'))} | {_fmt(loss)} | {back} |")
    lines += ["", "| bench | what | baseline | tserve | unit | speed-up |", "|---|---|---|---|---|---|"]
    for name in sorted(n for n in files if n.startswith("gpu-") and n.endswith(".json")):
        for r in json.loads(files[name]):
            ours = r.get("note") if r["tserve"] is None else _fmt(r["tserve"])
            if r.get("busy_of_timed_pct") is not None:  # the device's busy seconds over the unprofiled run's wall
                ours += f" (timed run: {r['busy_of_timed_pct']})"
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            lines.append(f"| {r['section']} | {r['what']} | {_fmt(r['baseline_value'])} | {ours} | {r['unit']} | "
                         f"{speed} |")
    for name in sorted(n for n in files if n.startswith("load-") and n.endswith(".json")):
        for r in json.loads(files[name]):
            lines.append(f"| {name[5:-5]} over HTTP | {r['system']}, {r['clients']} clients | - | "
                         f"{_fmt(r['tokens_per_s'])} | tokens/s (TTFT p50 {_fmt(r['ttft_p50'])} s) | - |")
    missing = [n for n in ("train.log", "tests.log", "bench.log") if n not in files]
    if missing:
        lines.append(f"missing from results.tar.gz: {', '.join(missing)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print("\n".join(summary(Path(args[0] if args else "/tmp/gpu-out"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
