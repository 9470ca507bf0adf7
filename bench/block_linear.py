"""llama.cpp's blocks on our kernels (`--quantize q8_0` / `q4_0`, `tserve/model/kernels/block_quant.cpp`) against
the int8 and int4 layers they sit beside, one linear layer at a time, at decode row counts (1 to 8) and a prefill
one: microseconds per call and the rate each reads its weights at, beside this machine's triad bandwidth.

    python bench/block_linear.py                                   # this CPU's kernels (AVX-512 VNNI here)
    python -m tserve.testing.avx2_only bench/block_linear.py        # held to AVX2 (the block kernels follow)
    python bench/block_linear.py --tiny                            # small shapes (the tests run this)
    python bench/block_linear.py --models --work DIR               # and one request's decode step, whole models
    python bench/block_linear.py --fused --work DIR                # decode steps layer by layer against fused
    python bench/block_linear.py --dense                           # the fused step's float32 product, per path

Shapes: GPT-2 small's layers and output layer, SmolLM2-135M's MLP and output layer. Weight bytes: int8 1 a
weight, int4 0.5 + 4 bytes a group of 32 (its PyTorch layout), Q8_0 34 and Q4_0 18 bytes a block of 32.
`--models`: GPT-2 small and SmolLM2-135M shapes (random weights) loaded as the server loads them in each format;
a decode step is (t(prompt + new tokens) - t(prompt + 1 token)) / (new - 1) of one greedy request, as
bench/roofline.py measures it, but the formats' runs taken in turns (best of --repeats each).
`--fused`: the same steps in float32, Q8_0 and Q4_0, each layer by layer (`--no-fused-layers`: float32 pre-packed)
and through every layer in one call (`--fused-layers`, `model.fused_decode`: float32 on its weights as they are), in
turns; the PyTorch operators a whole decode step dispatches (the profiler's count over (prompt + 9 tokens) -
(prompt + 1 token), / 8 steps: the layers' and what is outside them, the embedding, sampling and the runner's
bookkeeping); and the prompt's prefill with its first token (prefill runs layer by layer in both: fused models'
float32 products pack their weights per call).
`--dense`: the fused step's float32 product (`dense_rows.cpp`) on each path this CPU runs (AVX-512, AVX2) and
PyTorch's `F.linear` on Qwen2.5-0.5B's shapes (hidden 896, intermediate 4864, vocabulary 151936), in turns: µs a
call, the weights' GB/s and the GFLOP/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

SHAPES = [(768, 2304), (768, 3072), (3072, 768), (768, 50257), (576, 3072), (1536, 576), (576, 49152)]
FORMATS = ("int8", "int4", "q8_0", "q4_0")
DENSE_SHAPES = [(896, 4864), (4864, 896), (896, 151936)]  # Qwen2.5-0.5B's MLP up and down, output layer


def interleaved_us(fns: dict, calls: int) -> dict[str, float]:  # noqa: ANN001 - name -> a call
    """Each format's fastest call in µs, the calls of every format taken in turns. The fastest, not the median: on
    a shared machine a call whose threads lost the CPU waits out another process's time slice (tens of ms, far
    longer than the call), and taking the formats in turns gives each the same chances of a quiet moment."""
    times: dict[str, float] = dict.fromkeys(fns, float("inf"))
    for i in range(calls + 3):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= 3:  # the first calls warm the caches and the threads
                times[name] = min(times[name], time.perf_counter() - start)
    return {name: t * 1e6 for name, t in times.items()}


def decode_steps_in_turns(directory: Path, prompt: int, new: int, repeats: int) -> dict[str, float]:
    """ms per decode step of each format's model (`FORMATS` and float32), their timed runs taken in turns."""
    from tserve.model import checkpoint
    from tserve.model.decoding import SamplingParams, generate
    from tserve.model.decoding.lm_runner import DecoderRunner

    runs = {}
    for fmt in ("float32", *FORMATS):
        loaded = checkpoint.load(directory, device="cpu", quantize="none" if fmt == "float32" else fmt,
                                 pack_weights=True)
        runner = DecoderRunner(loaded, num_slots=1, cuda_graphs=False)
        ids = [[(7 * i + 3) % 200 + 10 for i in range(prompt)]]
        runs[fmt] = lambda tokens, loaded=loaded, runner=runner, ids=ids: generate(
            loaded, ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), runner=runner)
        runs[fmt](new)  # warm-up
    best = {(fmt, tokens): float("inf") for fmt in runs for tokens in (new, 1)}
    for _ in range(repeats):
        for (fmt, tokens), so_far in best.items():
            start = time.perf_counter()
            runs[fmt](tokens)
            best[fmt, tokens] = min(so_far, time.perf_counter() - start)
    return {fmt: (best[fmt, new] - best[fmt, 1]) / (new - 1) * 1000 for fmt in runs}


def fused_against_layers(directory: Path, prompt: int, new: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per format: ms a decode step and operators a step, layer by layer and fused, runs in turns. Each loaded as
    the server loads it: layer by layer with `--no-fused-layers` (float32 pre-packed), fused with `--fused-layers`
    (float32 on its weights as they are)."""
    from torch.profiler import ProfilerActivity, profile

    from tserve.model import checkpoint
    from tserve.model.decoding import SamplingParams, generate
    from tserve.model.decoding.lm_runner import DecoderRunner

    runs = {}
    for fmt in ("float32", "q8_0", "q4_0"):
        for mode in ("layers", "fused"):
            loaded = checkpoint.load(directory, device="cpu", quantize="none" if fmt == "float32" else fmt,
                                     pack_weights=True, fused_layers=mode == "fused")
            assert (loaded.model.fused is not None) == (mode == "fused"), f"{fmt}: fused {loaded.model.fused}"
            runner = DecoderRunner(loaded, num_slots=1, cuda_graphs=False)
            ids = [[(7 * i + 3) % 200 + 10 for i in range(prompt)]]
            runs[fmt, mode] = lambda tokens, loaded=loaded, runner=runner, ids=ids: generate(
                loaded, ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), runner=runner)
            runs[fmt, mode](new)  # warm-up
    best = {(fmt, mode, tokens): float("inf") for fmt, mode in runs for tokens in (new, 1)}
    for _ in range(repeats):
        for (fmt, mode, tokens), so_far in best.items():
            start = time.perf_counter()
            runs[fmt, mode](tokens)
            best[fmt, mode, tokens] = min(so_far, time.perf_counter() - start)
    out: dict[str, dict[str, float]] = {}
    for (fmt, mode), run in runs.items():
        row = out.setdefault(fmt, {})
        row[f"{mode}_ms"] = (best[fmt, mode, new] - best[fmt, mode, 1]) / (new - 1) * 1000
        row[f"{mode}_prefill_ms"] = best[fmt, mode, 1] * 1000
        counts = []
        for tokens in (9, 1):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(tokens)
            counts.append(sum(e.count for e in prof.key_averages()))
        row[f"{mode}_ops"] = (counts[0] - counts[1]) / 8
    return out


def dense_rows_in_turns(shapes: list[tuple[int, int]], row_counts: list[int], calls: int) -> list[dict]:
    """The float32 decode product on each of its paths and `F.linear`, each shape and row count, in turns."""
    import torch
    import torch.nn.functional as F

    from tserve.model.kernels import cpu as cpu_kernels

    ext = cpu_kernels.extension()
    rows = []
    with torch.inference_mode():
        for k, n in shapes:
            w = torch.randn(n, k) / k**0.5
            for m in row_counts:
                x = torch.randn(m, k)
                fns = {p: lambda p=p, x=x, w=w: ext.dense_rows_on(x, w, None, p) for p in ext.dense_rows_paths()}
                fns["F.linear"] = lambda x=x, w=w: F.linear(x, w)
                us = interleaved_us(fns, max(5, calls * 20_000_000 // (4 * k * n)))
                rows.append({"shape": f"{k}x{n}", "rows": m, "us": us,
                             "gb_s": {f: 4 * k * n / t / 1e3 for f, t in us.items()},
                             "gflop_s": {f: 2 * m * k * n / t / 1e3 for f, t in us.items()}})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--array-mb", type=int, default=256, help="triad arrays (bench/memory_traffic.py)")
    ap.add_argument("--models", action="store_true", help="also whole models' decode steps")
    ap.add_argument("--only-models", action="store_true", help="whole models' decode steps alone")
    ap.add_argument("--fused", action="store_true", help="whole models' decode steps, layer by layer and fused")
    ap.add_argument("--dense", action="store_true", help="the float32 decode product alone, per path")
    ap.add_argument("--work", default=None, help="where the --models checkpoints are made (kept for reruns)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch
    from torch import nn

    from bench.memory_traffic import bandwidth
    from tserve.model.block_quant import BlockLinear
    from tserve.model.kernels.cpu import kernel_isa
    from tserve.model.quantize import Int4Linear, Int8Linear, resolve_activations
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(64, 96), (96, 200)] if args.tiny else SHAPES
    activations = resolve_activations("auto")
    triad, _read = bandwidth(args.threads, 8 if args.tiny else args.array_mb, 3 if args.tiny else 5)
    if args.dense:
        rows = dense_rows_in_turns([(64, 96), (96, 200)] if args.tiny else DENSE_SHAPES, args.rows, args.calls)
        print(f"\nCPU: {cpu_name()} (ATen {torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; "
              f"triad {triad:.1f} GB/s; dense_rows on each path and F.linear, fastest call\n")
        print("| in x out | rows | path | µs | weight GB/s | GFLOP/s | of triad |\n|---|---|---|---|---|---|---|")
        for r in rows:
            for path, us in r["us"].items():
                print(f"| {r['shape']} | {r['rows']} | {path} | {us:.0f} | {r['gb_s'][path]:.1f} | "
                      f"{r['gflop_s'][path]:.1f} | {r['gb_s'][path] / triad:.2f} |")
        return rows
    rows = []
    with torch.inference_mode():
        for k, n in [] if args.only_models or args.fused else shapes:
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
    if rows:
        print("| in x out | rows | int8 µs | int4 µs | Q8_0 µs | Q4_0 µs | Q8_0 / int8 speed | Q4_0 / int4 speed "
              "| Q8_0 GB/s | Q4_0 GB/s | Q8_0 of triad |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        us, rate = r["us"], r["gb_s"]
        print(f"| {r['shape']} | {r['rows']} | {us['int8']:.0f} | {us['int4']:.0f} | {us['q8_0']:.0f} | "
              f"{us['q4_0']:.0f} | {us['int8'] / us['q8_0']:.2f}x | {us['int4'] / us['q4_0']:.2f}x | "
              f"{rate['q8_0']:.1f} | {rate['q4_0']:.1f} | {rate['q8_0'] / triad:.2f} |")
    if args.models or args.only_models or args.fused:
        from bench.load import make_checkpoint
        from bench.roofline import make_gpt2_small

        work = scratch_dir(args.work, "tserve-bench-blocks-")
        sizes = ["tiny"] if args.tiny else ["gpt2-small", "smollm2-135m"]
    if args.fused:
        print(f"\nOne greedy request's decode step, {args.prompt}-token prompt, {args.new - 1} steps, best of "
              f"{args.repeats}, layer by layer against one call through every layer, runs in turns\n")
        print("| model | format | layers ms | fused ms | speed-up | operators a step: layers | fused | "
              "prompt + 1 token ms: layers | fused |\n|---|---|---|---|---|---|---|---|---|")
        for size in sizes:
            directory = make_gpt2_small(work / size) if size == "gpt2-small" else make_checkpoint(size, work / size)
            result = fused_against_layers(directory, args.prompt, args.new, args.repeats)
            rows.append({"model": size, "fused": result})
            for fmt, r in result.items():
                print(f"| {size} | {fmt} | {r['layers_ms']:.2f} | {r['fused_ms']:.2f} | "
                      f"{r['layers_ms'] / r['fused_ms']:.2f}x | {r['layers_ops']:.0f} | {r['fused_ops']:.0f} | "
                      f"{r['layers_prefill_ms']:.1f} | {r['fused_prefill_ms']:.1f} |",
                      flush=True)
        return rows
    if args.models or args.only_models:
        print(f"\nOne greedy request's decode step, {args.prompt}-token prompt, {args.new - 1} steps, best of "
              f"{args.repeats}, formats in turns\n")
        print("| model | float32 ms | int8 ms | Q8_0 ms | int4 ms | Q4_0 ms | Q8_0 / int8 speed | Q4_0 / int4 speed "
              "|\n|---|---|---|---|---|---|---|---|")
        for size in sizes:
            directory = make_gpt2_small(work / size) if size == "gpt2-small" else make_checkpoint(size, work / size)
            ms = decode_steps_in_turns(directory, args.prompt, args.new, args.repeats)
            rows.append({"model": size, "step_ms": ms})
            print(f"| {size} | {ms['float32']:.2f} | {ms['int8']:.2f} | {ms['q8_0']:.2f} | {ms['int4']:.2f} | "
                  f"{ms['q4_0']:.2f} | {ms['int8'] / ms['q8_0']:.2f}x | {ms['int4'] / ms['q4_0']:.2f}x |", flush=True)
    return rows


if __name__ == "__main__":
    main()
