"""The generation engine's own time per decode step, apart from the model: what limits a GPU at many requests.

    python bench/engine_overhead.py                       # batches of 1, 8 and 64 requests, 200 steps each
    python bench/engine_overhead.py --batches 1 64 --steps 400
    python bench/engine_overhead.py --batches               # only the streamed text's cost a token (below)

A GPT-2 of one layer of width 32 on the CPU makes the model's share small; its forward pass alone (the
runner's decode at the same batch, no engine) is timed too, and the difference is the engine's: scheduling,
the next-token rules, detokenization and stop strings, and handing each request its event. The engine
thread's own CPU time per step (less the model's) is what a GPU waits for: a stream's reader detokenizes a
request without stop strings on the event loop, which overlaps the device. On a GPU with CUDA
graphs the model's step costs little more than a replay, so a step takes about this host time plus the
device's: at 64 requests the host time per row sets the throughput (docs/BENCHMARKS.md, GPU).

Last, the streamed text's own cost a token (part of the stream readers' work above, which this tiny model's
random tokens exercise poorly): `IncrementalDetokenizer` on a real text with each tokenizer's library stream
(tokenizers' DecodeStream) and without it (two decodes of the window a token), in turns in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root
from bench.scratch import scratch_dir  # noqa: E402 - after the path above


def tiny_lm(directory: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tserve.testing.checkpoints import write_bpe_tokenizer

    write_bpe_tokenizer(directory)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1000, n_positions=1024,
                               bos_token_id=999, eos_token_id=999)).save_pretrained(directory)
    return directory


def engine_ms_per_step(engine, batch: int, steps: int) -> float:
    from tserve.model.decoding import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> None:
        async for _ in engine.stream(engine.submit(ids, params)):
            pass

    async def run() -> None:
        await asyncio.gather(*(one(list(range(1 + i, 17 + i))) for i in range(batch)))

    start = time.perf_counter()
    asyncio.run(run())
    return (time.perf_counter() - start) / steps * 1e3


def model_ms_per_step(engine, batch: int, steps: int) -> float:
    """The runner's forward pass and next-token choice alone, on the engine's own cache rows."""
    from tserve.model.decoding import SamplingParams, TextSequence

    runner = engine.runner
    seqs = [TextSequence(list(range(1 + i, 17 + i)), SamplingParams(max_tokens=steps, temperature=0.0,
                                                                    ignore_eos=True)) for i in range(batch)]
    try:
        for seq in seqs:
            assert runner.admit(seq), "the engine's cache has no room for the batch"
        tokens, _ = runner.choose(seqs, runner.prefill(seqs))
        for seq, token in zip(seqs, tokens, strict=True):
            runner.append(seq, token)
        times = []
        for _ in range(steps - 1):
            start = time.perf_counter()
            for seq in seqs:
                runner.grow(seq)
            tokens, _ = runner.choose(seqs, runner.decode(seqs))
            times.append(time.perf_counter() - start)
            for seq, token in zip(seqs, tokens, strict=True):
                runner.append(seq, token)
    finally:
        for seq in seqs:
            runner.release(seq)
    return statistics.mean(times) * 1e3


def count_thread_time(engine) -> list[float]:
    """The CPU time the engine's own thread spends in each step (what a GPU waits on when the host is the
    bottleneck: the streams' readers, on the event loop, are not in it), appended to the returned list."""
    times: list[float] = []
    step = engine.step

    def timed_step() -> None:
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)

    engine.step = timed_step
    return times


STREAMED_TEXT = ("The committee met on Tuesday to review the budget. Über 40 Mädchen und Jungen kamen; "
                 "the café served crème brûlée 🍰 and 寿司. ") * 12


def detokenizer_table(rounds: int = 5) -> list[dict]:
    """Microseconds a token of `IncrementalDetokenizer.push` with and without the library's stream, alternating."""
    from tserve.model.detokenizer import IncrementalDetokenizer
    from tserve.model.tokenizer import load_tokenizer

    class WithoutStream:  # the same tokenizer with no `decode_stream`: the window's two decodes a token
        def __init__(self, tok) -> None:  # noqa: ANN001
            self.decode, self.decodes_bytes_lossily, self.special_ids = tok.decode, tok.decodes_bytes_lossily, \
                tok.special_ids

    rows = []
    print("\n| tokenizer | µs a token, library stream | µs a token, two decodes | ratio |\n|---|---|---|---|")
    for name, directory in (("tserve-lm (byte-level BPE)", ROOT / "models/tserve-lm"),
                            ("Llama 3 layout (byte-level BPE)", ROOT / "tests/fixtures/hf-llama"),
                            ("Mistral layout (SentencePiece, byte fallback)", ROOT / "tests/fixtures/hf-mistral")):
        tok = load_tokenizer(directory)
        ids = tok.encode(STREAMED_TEXT, add_special_tokens=False)
        best = {"stream": float("inf"), "decodes": float("inf")}
        for _ in range(rounds):
            for how, t in (("stream", tok), ("decodes", WithoutStream(tok))):
                start = time.perf_counter()
                detok = IncrementalDetokenizer(t)
                for i in ids:
                    detok.push(i)
                assert detok.text + detok.flush() == tok.decode(ids)
                best[how] = min(best[how], (time.perf_counter() - start) / len(ids) * 1e6)
        rows.append(dict(tokenizer=name, stream_us=best["stream"], decodes_us=best["decodes"]))
        print(f"| {name} | {best['stream']:.2f} | {best['decodes']:.2f} | {best['decodes'] / best['stream']:.2f}x |",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--detokenizer-rounds", type=int, default=5, help="rounds of the streamed text's table (0: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tserve.model import checkpoint
    from tserve.service import heap
    from tserve.service.engine import GenerationEngine
    from tserve.service.metrics import Metrics
    from tserve.training.common import cpu_name

    loaded = checkpoint.load(tiny_lm(scratch_dir(None, "tserve-overhead-")), device="cpu",
                             dtype="float32")
    rows = []
    print(f"CPU: {cpu_name()}; {args.threads} threads; {args.steps} steps per batch\n")
    print("| requests | engine ms/step | model ms/step | engine's own ms/step | per request, µs | engine thread's own "
          "CPU ms/step | per request, µs |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batches:
        engine = GenerationEngine("lm", loaded, max_slots=batch, max_queue=4 * batch, max_model_len=args.steps + 32,
                                  timeout_s=600.0, metrics=Metrics(), cuda_graphs=False)
        model = model_ms_per_step(engine, batch, args.steps)  # before the worker starts: one thread on the runner
        thread_s = count_thread_time(engine)
        engine.start()
        try:
            engine_ms_per_step(engine, batch, min(args.steps, 20))  # warm-up
            heap.freeze()  # as the server does once its models are ready (--gc-freeze)
            thread_s.clear()
            total = engine_ms_per_step(engine, batch, args.steps)
        finally:
            engine.stop()
            heap.thaw()
        own = max(total - model, 0.0)
        thread_own = max(sum(thread_s) / len(thread_s) * 1e3 - model, 0.0)
        rows.append(dict(requests=batch, engine_ms=total, model_ms=model, own_ms=own,
                         per_request_us=own / batch * 1e3, thread_own_ms=thread_own))
        print(f"| {batch} | {total:.3f} | {model:.3f} | {own:.3f} | {own / batch * 1e3:.0f} | {thread_own:.3f} | "
              f"{thread_own / batch * 1e3:.0f} |", flush=True)
    if args.detokenizer_rounds:
        rows += detokenizer_table(args.detokenizer_rounds)
    return rows


if __name__ == "__main__":
    main()
