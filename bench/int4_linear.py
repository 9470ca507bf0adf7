"""One linear layer at one row (a decode step), float32 pre-packed vs int8 vs int4, in microseconds per call and
the bandwidth each reads its weights at; the shapes of GPT-2 small's layers and output layer.

    python bench/int4_linear.py                  # 2 threads
    python bench/int4_linear.py --tiny           # small shapes (the tests run this)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257)]


def per_call_us(fn, calls: int) -> float:  # noqa: ANN001
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> list[tuple[str, float, float, float, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    import torch
    from torch import nn

    from tserve.model.packed_linear import PackedLinear
    from tserve.model.quantize import Int4Linear, Int8Linear, resolve_activations
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    shapes = [(64, 96), (96, 200)] if args.tiny else SHAPES
    activations = resolve_activations("auto")
    rows = []
    with torch.inference_mode():
        for k, n in shapes:
            linear = nn.Linear(k, n)
            x = torch.randn(1, k)
            layers = (PackedLinear(linear), Int8Linear(linear, activations), Int4Linear(linear, 32))
            fp32, int8, int4 = (per_call_us(lambda layer=layer, x=x: layer(x), args.calls) for layer in layers)
            rows.append((f"{k}x{n}", fp32, int8, int4, layers[2].weight_bytes() / int4 / 1e3))
    print(f"\nCPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; one row, "
          f"int8 activations {activations}\n")
    print("| in x out | float32 µs | int8 µs | int4 µs | int4 GB/s | int8 GB/s |\n|---|---|---|---|---|---|")
    for name, fp32, int8, int4, int4_rate in rows:
        k, n = map(int, name.split("x"))
        print(f"| {name} | {fp32:.0f} | {int8:.0f} | {int4:.0f} | {int4_rate:.1f} | {k * n / int8 / 1e3:.1f} |")
    return rows


if __name__ == "__main__":
    main()
