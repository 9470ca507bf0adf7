"""llama.cpp's blocks on our kernels (`--quantize q8_0` / `q4_0`, `tserve/model/kernels/block_quant.cpp`) against
the int8 and int4 layers they sit beside, one linear layer at a time, at decode row counts (1 to 8) and a prefill
one: microseconds per call and the rate each reads its weights at, beside this machine's triad bandwidth.

    python bench/block_linear.py                                   # this CPU's kernels (AVX-512 VNNI here)
    python -m tserve.testing.avx2_only bench/block_linear.py        # held to AVX2 (the block kernels follow)
    python bench/block_linear.py --tiny                            # small shapes (the tests run this)

Shapes: GPT-2 small's layers and output layer, SmolLM2-135M's MLP and output layer. Weight bytes: int8 1 a
weight, int4 0.5 + 4 bytes a group of 32 (its PyTorch layout), Q8_0 34 and Q4_0 18 bytes a block of 32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = [(768, 2304), (768, 3072), (3072, 768), (768, 50257), (576, 3072), (1536, 576), (576, 49152)]
FORMATS = ("int8", "int4", "q8_0", "q4_0")


def interleaved_us(fns: dict, calls: int) -> dict[str, float]:  # noqa: ANN001 - name -> a call
    """Each call's median time in µs, the calls of every format taken in turn (a busy spell of a shared machine
    then slows all of them alike, not the one running at the time)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(calls + 3):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= 3:  # the first calls warm the caches and the threads
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--array-mb", type=int, default=256, help="triad arrays (bench/memory_traffic.py)")
    args = ap.parse_args(argv)
    import torch
    from torch import nn

    from bench.memory_traffic import bandwidth
    from tserve.model.block_quant import BlockLinear, kernel_isa
    from tserve.model.quantize import Int4Linear, Int8Linear, resolve_activations
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(64, 96), (96, 200)] if args.tiny else SHAPES
    activations = resolve_activations("auto")
    triad, _read = bandwidth(args.threads, 8 if args.tiny else args.array_mb, 3 if args.tiny else 5)
    rows = []
    with torch.inference_mode():
        for k, n in shapes:
            linear = nn.Linear(k, n)
            layers = {"int8": Int8Linear(linear, activations), "int4": Int4Linear(linear, 32),
                      "q8_0": BlockLinear(linear, "q8_0"), "q4_0": BlockLinear(linear, "q4_0")}
            weight_bytes = {"int8": k * n, "int4": layers["int4"].weight_bytes(),
                            "q8_0": layers["q8_0"].weight_bytes(), "q4_0": layers["q4_0"].weight_bytes()}
            for m in args.rows:
                x = torch.randn(m, k)
                us = interleaved_us({f: lambda layer=layer, x=x: layer(x) for f, layer in layers.items()},
                                    max(3, args.calls // max(1, m // 8)))
                rows.append({"shape": f"{k}x{n}", "rows": m, "us": us,
                             "gb_s": {f: weight_bytes[f] / us[f] / 1e3 for f in FORMATS}})
    print(f"\nCPU: {cpu_name()} (ATen {torch.backends.cpu.get_cpu_capability()}, block kernels: "
          f"{kernel_isa() or 'PyTorch statement'}), {args.threads} threads; int8 activations {activations}; "
          f"triad {triad:.1f} GB/s\n")
    print("| in x out | rows | int8 µs | int4 µs | Q8_0 µs | Q4_0 µs | Q8_0 / int8 speed | Q4_0 / int4 speed "
          "| Q8_0 GB/s | Q4_0 GB/s | Q8_0 of triad |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        us, rate = r["us"], r["gb_s"]
        print(f"| {r['shape']} | {r['rows']} | {us['int8']:.0f} | {us['int4']:.0f} | {us['q8_0']:.0f} | "
              f"{us['q4_0']:.0f} | {us['int8'] / us['q8_0']:.2f}x | {us['int4'] / us['q4_0']:.2f}x | "
              f"{rate['q8_0']:.1f} | {rate['q4_0']:.1f} | {rate['q8_0'] / triad:.2f} |")
    return rows


if __name__ == "__main__":
    main()
