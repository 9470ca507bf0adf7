"""A prompt's prefill on the CPU: the attention of its positions on our kernel (`cpu-decode`, what `auto` is on the
CPU) against PyTorch's CPU flash attention (`sdpa`, grouped kv heads repeated first, as `sdpa` runs them), each path
of the kernel this CPU runs; then whole prompts through a model of a published shape on both backends, in turns in
one process, and, given llama.cpp's `llama-bench`, its prompt processing on the same weights (GGUF files made by
its own converter and `llama-quantize`, as bench/llama_cpp.py makes them). Random weights, prompts of fixed ids.

    python bench/prefill.py                          # SmolLM2-135M shape, prompts of 512 and 2,048 tokens
    python bench/prefill.py --llama-bench BIN --llama-cpp-src DIR --work DIR
    python bench/prefill.py --tiny                   # small shapes, short prompts (the tests run this)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode_attention import SHAPES as ATTENTION_SHAPES  # noqa: E402 - (query heads, kv heads, width, layers)
from bench.scratch import scratch_dir  # noqa: E402

TINY_ATTENTION = {"tiny": (4, 2, 32, 2)}
FORMATS = {"float32": ("none", "f32"), "q8_0": ("q8_0", "Q8_0"), "q4_0": ("q4_0", "Q4_0")}  # tserve's, llama.cpp's


def best_of(run, rounds: int) -> float:  # noqa: ANN001 - run() does the work once
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def attention_rows(shapes: list[str], lengths: list[int], rounds: int) -> list[dict]:
    """One layer's attention of a whole prompt, per path, in turns: ms and GMAC/s (the causal half's
    multiply-adds, scores and value sums)."""
    import torch  # noqa: PLC0415

    from tserve.model import attention  # noqa: PLC0415
    from tserve.model.kernels import cpu as cpu_kernels  # noqa: PLC0415

    paths = cpu_kernels.extension().block_isas() if cpu_kernels.available() else []
    rows = []
    for shape in shapes:
        heads, kv_heads, width, _ = {**ATTENTION_SHAPES, **TINY_ATTENTION}[shape]
        for length in lengths:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, length, heads, width, generator=g).transpose(1, 2)
            k, v = (torch.randn(1, length, kv_heads, width, generator=g).transpose(1, 2) for _ in range(2))
            runs = {"sdpa": functools.partial(attention._grouped, attention.sdpa_attention, q, k, v, None, True, 0.0)}
            runs |= {isa: functools.partial(cpu_kernels.prefill_attention, q, k, v, True, isa=isa) for isa in paths}
            seconds = {name: math.inf for name in runs}
            for _ in range(rounds):  # in turns: each path sees the machine as the others do
                for name, run in runs.items():
                    seconds[name] = min(seconds[name], best_of(run, 1))
            macs = 2 * heads * length * (length + 1) / 2 * width
            for name, s in seconds.items():
                rows.append({"shape": shape, "tokens": length, "path": name, "ms": s * 1e3, "gmacs": macs / s / 1e9,
                             "vs_sdpa": seconds["sdpa"] / s})
    return rows


def model_rows(size: str, lengths: list[int], formats: list[str], rounds: int, work: Path) -> list[dict]:
    """Whole prompts through the model (prefill and its first token), `cpu-decode` and `sdpa` in turns, the best
    of `rounds` each: prompt tokens a second."""
    from bench.load import make_checkpoint  # noqa: PLC0415
    from tserve.model import checkpoint  # noqa: PLC0415
    from tserve.model.decoding import SamplingParams, generate  # noqa: PLC0415
    from tserve.model.decoding.lm_runner import DecoderRunner  # noqa: PLC0415
    from tserve.model.layers import set_attention_backend  # noqa: PLC0415

    directory = make_checkpoint(size, work / size)
    rows = []
    for fmt in formats:
        loaded = checkpoint.load(directory, device="cpu", quantize=FORMATS[fmt][0], pack_weights=True)
        assert loaded.model.blocks[0].attn.backend == "cpu-decode", "the CPU kernels are not built"
        for length in lengths:
            runner = DecoderRunner(loaded, num_slots=1, max_len=length + 8, cuda_graphs=False)
            seconds = {"cpu-decode": math.inf, "sdpa": math.inf}
            prompt = 0
            for _ in range(rounds + 1):  # the first round warms up
                for backend in seconds:
                    set_attention_backend(loaded.model, backend)
                    prompt += 1  # a prompt of its own each time: no prefix to find in the cache
                    ids = [[(7 * i + prompt) % 200 + 10 for i in range(length)]]
                    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                    took = best_of(functools.partial(generate, loaded, ids, params, runner=runner), 1)
                    seconds[backend] = took if prompt <= 2 else min(seconds[backend], took)
            for backend in seconds:
                rows.append({"model": size, "format": fmt, "tokens": length, "system": f"tserve {backend}",
                             "tok_s": length / seconds[backend]})
    return rows


def llama_rows(size: str, lengths: list[int], formats: list[str], threads: int, args: argparse.Namespace,
               work: Path) -> list[dict]:
    """llama-bench's prompt processing (`-p N -n 0`, its default 5 repetitions) on the same weights."""
    from bench.llama_cpp import make_shape, quantized, to_gguf  # noqa: PLC0415

    f32 = to_gguf(make_shape(size, work), args.llama_cpp_src, work)
    rows = []
    for fmt in formats:
        model = quantized(args.llama_bench.with_name("llama-quantize"), f32, FORMATS[fmt][1], threads)
        out = subprocess.run([str(args.llama_bench), "-m", str(model), "-t", str(threads), "-p",
                              ",".join(map(str, lengths)), "-n", "0", "-o", "json"], check=True, capture_output=True,
                             text=True).stdout
        for test in json.loads(out):
            rows.append({"model": size, "format": fmt, "tokens": test["n_prompt"], "system": "llama.cpp",
                         "tok_s": test["avg_ts"]})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b", "gpt2-small"],
                    choices=sorted(ATTENTION_SHAPES), help="attention shapes")
    ap.add_argument("--model", default="smollm2-135m", help="the whole model's shape (bench/load.py's sizes)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="prompt lengths")
    ap.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench (llama-quantize beside it)")
    ap.add_argument("--llama-cpp-src", type=Path, help="vendor/llama.cpp of llama-cpp-python's sdist (its converter)")
    ap.add_argument("--work", default=None, help="directory for checkpoints and GGUF files (default: a new one)")
    ap.add_argument("--tiny", action="store_true", help="small shapes, short prompts (a smoke test)")
    args = ap.parse_args(argv)
    if args.llama_bench and not args.llama_cpp_src:
        ap.error("--llama-bench needs --llama-cpp-src (llama.cpp's converter makes its GGUF files)")
    if args.tiny:
        args.shapes, args.model, args.tokens, args.rounds = ["tiny"], "tiny-llama", [40, 70], 1
        args.formats = args.formats[:2]
    import torch  # noqa: PLC0415

    from tserve.training.common import cpu_name  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    work = scratch_dir(args.work, "tserve-bench-prefill-")
    attention = attention_rows(args.shapes, args.tokens, args.rounds)
    models = model_rows(args.model, args.tokens, args.formats, args.rounds, work)
    if args.llama_bench:
        models += llama_rows(args.model, args.tokens, args.formats, args.threads, args, work)
    print(f"\nCPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads\n")
    print("| shape | prompt tokens | attention | ms a layer | GMAC/s | speed over sdpa |\n|---|---|---|---|---|---|")
    for r in attention:
        print(f"| {r['shape']} | {r['tokens']} | {r['path']} | {r['ms']:.2f} | {r['gmacs']:.0f} | {r['vs_sdpa']:.2f}x |")
    print("\n| model | format | prompt tokens | system | prompt tok/s | over llama.cpp |\n|---|---|---|---|---|---|")
    theirs = {(r["format"], r["tokens"]): r["tok_s"] for r in models if r["system"] == "llama.cpp"}
    for r in models:
        ratio = theirs.get((r["format"], r["tokens"]))
        cell = f"{r['tok_s'] / ratio:.2f}x" if ratio else "-"
        print(f"| {r['model']} | {r['format']} | {r['tokens']} | {r['system']} | {r['tok_s']:.0f} | {cell} |")
    return {"attention": attention, "models": models}


if __name__ == "__main__":
    main()
