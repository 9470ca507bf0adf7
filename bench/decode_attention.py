"""One-token attention over a paged float32 KV cache, a whole decode step of it (every layer its own cache, read
from memory: a larger array is swept between steps), on each path of the CPU kernel (`avx2`, `avx512`) that this
CPU runs, each in its own process (a process runs one path), in turns; milliseconds a step and the GB/s of cache
read. Random keys and values in the published shapes; one row, its blocks of 16 positions in a shuffled order.

    python bench/decode_attention.py                        # SmolLM2-135M and Qwen2.5-0.5B shapes, 160 / 1,024 positions
    python bench/decode_attention.py --positions 4096 --threads 1
    python bench/decode_attention.py --tiny                 # small shapes (the tests run this)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: (query heads, kv heads, head width, layers)
SHAPES = {"smollm2-135m": (9, 3, 64, 30), "qwen2.5-0.5b": (14, 2, 64, 24), "gpt2-small": (12, 12, 64, 12)}
TINY = {"tiny": (4, 2, 32, 2)}
BLOCK = 16


def time_path(isa: str, shape: tuple[int, int, int, int], positions: int, threads: int, steps: int,
              sweep_mb: int) -> list[float]:
    """Seconds of each step, on `isa`, in this process."""
    import torch  # noqa: PLC0415

    from tserve.model.kernels import cpu as cpu_kernels  # noqa: PLC0415

    torch.set_num_threads(threads)
    heads, kv_heads, width, layers = shape
    blocks = positions // BLOCK + 1
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(layers, 2, 2 * blocks * BLOCK, kv_heads, width, generator=generator)  # half the blocks unused
    table = torch.randperm(2 * blocks, generator=generator)[:blocks][None]
    lengths = torch.tensor([positions])
    q = torch.randn(1, heads, width, generator=generator)
    sweep = torch.zeros(sweep_mb * 1024 * 1024 // 4)
    ext = cpu_kernels.extension()
    times = []
    for _ in range(steps + 2):
        sweep.add_(1.0)
        start = time.perf_counter()
        for layer in range(layers):
            ext.paged_decode(q, pool[layer, 0], pool[layer, 1], table, lengths, BLOCK, width ** -0.5, 0, isa)
        times.append(time.perf_counter() - start)
    return times[2:]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"], choices=sorted(SHAPES))
    ap.add_argument("--positions", nargs="+", type=int, default=[160, 1024])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="steps timed a process (the median is reported)")
    ap.add_argument("--rounds", type=int, default=3, help="processes a path, in turns with the other path's")
    ap.add_argument("--sweep-mb", type=int, default=64)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: time one path here, print JSON
    args = ap.parse_args(argv)
    shapes = TINY if args.tiny else {name: SHAPES[name] for name in args.shapes}
    if args.one:
        isa, name, positions = args.one.split(",")
        print(json.dumps(time_path(isa, {**SHAPES, **TINY}[name], int(positions), args.threads, args.steps,
                                   args.sweep_mb)))
        return []

    from tserve.model.kernels import cpu as cpu_kernels  # noqa: PLC0415
    from tserve.training.common import cpu_name  # noqa: PLC0415

    isas = [isa for isa in ("avx2", "avx512") if isa in cpu_kernels.extension().block_isas()]
    rows = []
    for name, shape in shapes.items():
        for positions in args.positions:
            medians = {isa: [] for isa in isas}
            for _ in range(args.rounds):
                for isa in isas:
                    out = subprocess.run(
                        [sys.executable, __file__, "--one", f"{isa},{name},{positions}", "--threads",
                         str(args.threads), "--steps", str(args.steps), "--sweep-mb", str(args.sweep_mb)],
                        check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                    medians[isa].append(statistics.median(json.loads(out.stdout.strip().splitlines()[-1])))
            heads, kv_heads, width, layers = shape
            megabytes = 2 * layers * positions * kv_heads * width * 4 / 1e6
            rows.append({"shape": name, "positions": positions, "MB": megabytes,
                         **{isa: sorted(m) for isa, m in medians.items()}})
    print(f"\nCPU: {cpu_name()}, {args.threads} thread(s); one row, a whole step's layers, each path in its own "
          f"process ({args.rounds} a path, in turns), the median of {args.steps} steps each\n")
    print("| shape | positions | cache MB a step | " + " | ".join(f"{isa} ms (GB/s)" for isa in isas) + " |")
    print("|---|---|---|" + "---|" * len(isas))
    for row in rows:
        cells = [f"{min(row[isa]) * 1e3:.3f}-{max(row[isa]) * 1e3:.3f} ({row['MB'] / statistics.median(row[isa]) / 1e3:.1f})"
                 for isa in isas]
        print(f"| {row['shape']} | {row['positions']:,} | {row['MB']:.1f} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
