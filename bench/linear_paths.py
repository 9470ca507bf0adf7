"""float32 linear layers at decode row counts: PyTorch's `F.linear` (MKL, which re-packs the weight on each call)
against the weight pre-packed once for oneDNN (`model.packed_linear`, what served float32 CPU models use).

    python bench/linear_paths.py                                   # this CPU's kernels
    python -m tserve.testing.avx2_only bench/linear_paths.py        # held to AVX2

Shapes: the opus-mt-en-de shape's projections (d512, FFN 2048, its 15,900-token output layer) and a 1536 one.
Prints µs per product (median of 60 rounds over 4 inputs) and the packed/F.linear time ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root

SHAPES = [(512, 512), (512, 1536), (512, 2048), (2048, 512), (512, 15900)]


def median_us(fn, inputs: list[torch.Tensor], rounds: int) -> float:  # noqa: ANN001
    for x in inputs:
        fn(x)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for x in inputs:
            fn(x)
        times.append((time.perf_counter() - start) / len(inputs))
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 128])
    ap.add_argument("--shapes", nargs="+", default=[f"{i}x{o}" for i, o in SHAPES], help="IN x OUT")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from tserve.model.packed_linear import PackedLinear
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU: {cpu_name()}; ATen ISA {torch.backends.cpu.get_cpu_capability()}; {args.threads} threads\n")
    print("| rows | in → out | F.linear µs | packed µs | packed / F.linear |\n|---|---|---|---|---|")
    rows_out = []
    for rows in args.rows:
        for shape in args.shapes:
            n_in, n_out = (int(v) for v in shape.split("x"))
            linear = torch.nn.Linear(n_in, n_out).eval()
            packed = PackedLinear(linear)
            inputs = [torch.randn(rows, n_in) for _ in range(4)]
            with torch.inference_mode():
                plain = median_us(lambda x, m=linear: F.linear(x, m.weight, m.bias), inputs, args.rounds)
                pre = median_us(packed, inputs, args.rounds)
            rows_out.append(dict(rows=rows, n_in=n_in, n_out=n_out, linear_us=plain, packed_us=pre))
            print(f"| {rows} | {n_in} → {n_out} | {plain:.1f} | {pre:.1f} | {pre / plain:.2f} |", flush=True)
    return rows_out


if __name__ == "__main__":
    main()
