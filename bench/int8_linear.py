"""What each way of quantizing int8 activations costs, one linear layer at a time, in one run.

    python bench/int8_linear.py                              # this CPU's kernels
    python -m tserve.testing.avx2_only bench/int8_linear.py   # fbgemm (and ATen) held to AVX2

Columns: float32 `nn.Linear`; `Int8Linear` with 8-bit activations (`full`, one GEMM: PyTorch's where it sums in
int32, else our exact kernel, tserve/model/kernels/int8_gemm.cpp; marked overflow where neither serves), with split activations (two 7-bit halves, one GEMM of twice the rows)
with 7-bit ones (`7bit`, one GEMM) and with 8-bit ones on 7-bit weights (`7bit-weights`, one GEMM); and
PyTorch's own dynamic Linear (7-bit activations, one scale per
batch, no per-row mapping). Shapes: opus-mt-en-de's (512 wide,
2048 feed-forward) and the bundled translator's (256, 768); rows: one decode step of 1 to 64 requests, and a
prefill. Reported: microseconds per call, the median of `--repeats` timed loops."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tserve.model.quantize import Int8Linear, full_activations_kernel  # noqa: E402

SHAPES = {"opus-mt 512x2048": (512, 2048), "opus-mt 2048x512": (2048, 512), "bundled 256x768": (256, 768)}


def per_call_us(fn, x: torch.Tensor, repeats: int, calls: int) -> float:  # noqa: ANN001
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=None, help="calls per timed loop (default: by size)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    full_kernel = full_activations_kernel()
    full_ok = full_kernel is not None
    full_on = {"pytorch": "PyTorch's kernel", "exact": "our exact kernel", None: "nothing: overflow"}[full_kernel]
    print(f"torch {torch.__version__}, {args.threads} threads, ATen {torch.backends.cpu.get_cpu_capability()}, "
          f"8-bit activations (full) on {full_on}")
    print("| shape | rows | float32 | int8 full | int8 split | int8 7bit | int8 7bit-weights | PyTorch 7-bit per batch "
          "| split / 7bit |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = []
    for name, (k, n) in SHAPES.items():
        linear = nn.Linear(k, n)
        split, seven, seven_w = (Int8Linear(linear, a) for a in ("split", "7bit", "7bit-weights"))
        full = Int8Linear(linear, "full") if full_ok else None
        dynamic = torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)
        for rows in args.rows:
            x = torch.randn(rows, k)
            calls = args.calls or max(5, 20_000 // rows // max(k // 256, 1))
            f32 = per_call_us(linear, x, args.repeats, calls)
            f8 = per_call_us(full, x, args.repeats, calls) if full_ok else float("nan")
            sp = per_call_us(split, x, args.repeats, calls)
            s7 = per_call_us(seven, x, args.repeats, calls)
            w7 = per_call_us(seven_w, x, args.repeats, calls)
            d7 = per_call_us(dynamic, x, args.repeats, calls)
            f8_text = f"{f8:.0f}" if full_ok else "overflow"
            print(f"| {name} | {rows} | {f32:.0f} | {f8_text} | {sp:.0f} | {s7:.0f} | {w7:.0f} | {d7:.0f} | "
                  f"{sp / s7:.2f}x |", flush=True)
            table.append({"shape": name, "rows": rows, "float32": f32, "full": f8, "split": sp, "7bit": s7,
                          "7bit-weights": w7, "dynamic7": d7})
    return table


if __name__ == "__main__":
    main()
