"""Decoding at the memory roofline: how fast this machine reads memory, how many bytes one decode step of a
language model reads (its weights and its KV cache), and how close tserve's decode step comes to the time
those bytes take.

    python bench/roofline.py                      # GPT-2 small and SmolLM2-135M shapes, float32, int8, int4
                                                  # and bfloat16 (emulated without AVX512-BF16 or AMX)
    python bench/roofline.py --tiny               # tiny shapes, small arrays (the tests run this)
    python bench/roofline.py --formats int8 q8_0 int4 q4_0   # llama.cpp's blocks beside int8 and int4

Bandwidth: a STREAM-style triad `a = b + 3 c` over float32 arrays of --array-mb each (bytes: 3 arrays; best
of --repeats), and a read-only pass (`sum`) over one array, with --threads threads. A decode step reads every
weight once (the embedding table one row, unless it is also the output layer) and the KV cache of its
context; its time is measured as (t(prompt + N new tokens) - t(prompt + 1 new token)) / (N - 1) with one
greedy request on the model's runner, so prefill is not in it. The model is loaded as the server loads it
(float32 linear layers on pre-packed oneDNN weights). Reported: bytes per step, ms per step, the
bandwidth that implies, and its fraction of each measured bandwidth (the roofline: 1.0 is every byte at the
machine's best rate). `x HF`: the step's speed against `transformers`' float32 decode step of the same weights,
measured the same way in the same run (greedy `generate`, eager attention).

A machine's bandwidth moves while it runs (a shared host: the triad read 43 to 72 GB/s within an hour on one
2-core VM), so `--rounds N` measures it N times, each round the bandwidth and then every model's step in turn:
a row's fractions are the median of its rounds' (its step against the bandwidth measured just before it), its
ms the median step. Each round also says where the two first CPUs sit (a cache line's round trip between them:
on a VM the same two vCPUs ~50-100 ns apart on one CCD, ~200-400 ns on two, where each has its own path to memory
and the triad reads ~1.6x faster) and how fast our Q4_0 kernel reads one product of one row far larger than the
caches (`product`, where the block kernels run): `of product` is the step's rate against it, what a step loses
to its ~150 products a step being small, the loops' hand-overs and the work between them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkpoints come from bench/load.py's makers
from bench.memory_traffic import (  # noqa: E402 - after the path above
    bandwidth,
    core_round_trip_ns,
    product_bandwidth,
    step_bytes,
)
from bench.scratch import scratch_dir  # noqa: E402 - after the path above


@dataclass
class Row:
    model: str
    fmt: str
    weight_mb: float
    kv_mb: float
    ms_per_step: float
    gb_per_s: float
    of_triad: float
    of_product: float | None
    of_read: float
    vs_hf: float  # HF float32's ms per step / this row's


def step_ms(loaded, prompt: int, new: int, repeats: int) -> float:  # noqa: ANN001
    from tserve.model.decoding import SamplingParams, generate
    from tserve.model.decoding.lm_runner import DecoderRunner

    # A cache for this one request (not the model's whole context: Phi-4-mini's 131,072 positions are 17 GB).
    runner = DecoderRunner(loaded, num_slots=1, max_len=prompt + new + 16, cuda_graphs=False)
    ids = [[(7 * i + 3) % 200 + 10 for i in range(prompt)]]
    greedy = dict(temperature=0.0, ignore_eos=True)
    return _per_step_ms(lambda tokens: generate(loaded, ids, SamplingParams(max_tokens=tokens, **greedy),
                                                runner=runner), new, repeats)


def hf_step_ms(directory: Path, prompt: int, new: int, repeats: int) -> float:
    """`transformers`' float32 decode step on the same weights, measured as `step_ms` measures tserve's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([[(7 * i + 3) % 200 + 10 for i in range(prompt)]])

    def run(tokens: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, pad_token_id=0)

    return _per_step_ms(run, new, repeats)


def _per_step_ms(run, new: int, repeats: int) -> float:  # noqa: ANN001 - run(tokens) generates that many
    """One decode step: (a run of `new` tokens - a run of one) / (new - 1), each the best of `repeats`, taken in
    turns so that both see the same load (on a busy machine, all the short runs timed after all the long ones
    could come out slower than them)."""
    run(new)  # warm-up
    best = {new: float("inf"), 1: float("inf")}
    for _ in range(repeats):
        for tokens in best:
            start = time.perf_counter()
            run(tokens)
            best[tokens] = min(best[tokens], time.perf_counter() - start)
    return (best[new] - best[1]) / (new - 1) * 1000


def make_gpt2_small(directory: Path) -> Path:
    """GPT-2 small as published (vocabulary 50,257, 1,024 positions), random weights; the tokenizer files of the
    committed test fixture hf-gpt2 (the benchmark feeds token ids)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tserve.testing.checkpoints import copy_tokenizer_and_config

    if not (directory / "model.safetensors").exists():
        copy_tokenizer_and_config(ROOT / "tests" / "fixtures" / "hf-gpt2", directory)
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_layer=12, n_embd=768, n_head=12,
                         bos_token_id=50256, eos_token_id=50256)
        GPT2LMHeadModel(cfg).eval().save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--array-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="bandwidth, then every step; this many times")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=65)
    ap.add_argument("--work", default=None)
    ap.add_argument("--formats", nargs="+", default=["float32", "int8", "int4", "bfloat16"],
                    choices=["float32", "int8", "int4", "bfloat16", "q8_0", "q4_0"])
    args = ap.parse_args(argv)
    sizes = ["gpt2-small", "smollm2-135m"]
    if args.tiny:
        # 64 steps measured: a tiny model's steps must sum to more than the noise of the one-token run
        sizes, args.array_mb, args.repeats, args.prompt, args.new = ["tiny", "tiny-llama"], 16, 5, 16, 65
    import torch

    from bench.load import make_checkpoint
    from tserve.model import checkpoint
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    work = scratch_dir(args.work, "tserve-bench-roofline-")
    models = []  # (model name, format, loaded, weight bytes, KV bytes, HF float32's ms)
    for size in sizes:
        directory = make_gpt2_small(work / size) if size == "gpt2-small" else make_checkpoint(size, work / size)
        hf_ms = hf_step_ms(directory, args.prompt, args.new, args.repeats)
        for fmt in args.formats:
            loaded = checkpoint.load(directory, device="cpu", dtype="bfloat16" if fmt == "bfloat16" else "float32",
                                     quantize="none" if fmt in ("float32", "bfloat16") else fmt, pack_weights=True,
                                     fused_layers=True)
            weights, kv = step_bytes(loaded, args.prompt + args.new // 2)
            models.append((f"{size} (vocab {loaded.config.vocab_size:,})", fmt, loaded, weights, kv, hf_ms))
    rounds = []  # per round: (triad, read, [ms per model], Q4_0 product GB/s or None, round trip ns or None)
    for _ in range(max(1, args.rounds)):
        trip = core_round_trip_ns()
        triad, read = bandwidth(args.threads, args.array_mb, args.repeats)
        product = product_bandwidth(args.threads, args.array_mb, args.repeats)
        rounds.append((triad, read, [step_ms(m[2], args.prompt, args.new, args.repeats) for m in models], product,
                       trip))
    rows = []
    for i, (name, fmt, _, weights, kv, hf_ms) in enumerate(models):
        ms = statistics.median(r[2][i] for r in rounds)
        rates = [(weights + kv) / (r[2][i] / 1000) / 1e9 for r in rounds]  # GB/s, each round's
        of_triad = statistics.median(rate / r[0] for rate, r in zip(rates, rounds, strict=True))
        of_read = statistics.median(rate / r[1] for rate, r in zip(rates, rounds, strict=True))
        of_product = (statistics.median(rate / r[3] for rate, r in zip(rates, rounds, strict=True))
                      if all(r[3] for r in rounds) else None)
        rows.append(Row(name, fmt, weights / 1e6, kv / 1e6, ms, (weights + kv) / (ms / 1000) / 1e9, of_triad,
                        of_product, of_read, hf_ms / ms))
    triads = ", ".join(f"{r[0]:.1f}" for r in rounds)
    reads = ", ".join(f"{r[1]:.1f}" for r in rounds)
    products = ", ".join("-" if r[3] is None else f"{r[3]:.1f}" for r in rounds)
    trips = ", ".join("-" if r[4] is None else f"{r[4]:.0f}" for r in rounds)
    print(f"\nCPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; "
          f"triad {triads} GB/s, read {reads} GB/s ({args.array_mb} MB arrays; {len(rounds)} round(s)); Q4_0 product "
          f"{products} GB/s; the first two CPUs' round trip {trips} ns; one greedy request, {args.prompt}-token "
          f"prompt, {args.new - 1} steps measured\n")
    print("| model | weights | weights MB/step | KV MB/step | ms/step | GB/s | of triad | of product | of read | "
          "x HF float32 |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        product = "-" if r.of_product is None else f"{r.of_product:.2f}"
        print(f"| {r.model} | {r.fmt} | {r.weight_mb:.1f} | {r.kv_mb:.2f} | {r.ms_per_step:.2f} | {r.gb_per_s:.1f} | "
              f"{r.of_triad:.2f} | {product} | {r.of_read:.2f} | {r.vs_hf:.2f} |")
    return rows


if __name__ == "__main__":
    main()
