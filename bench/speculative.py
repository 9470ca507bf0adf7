"""Speculative decoding with prompt-lookup drafts, measured: one client, with and without `--speculative ngram`,
same run, alternating.

    python bench/speculative.py                 # the bundled LM on its test passages, and step costs on GPT-2 small
    python bench/speculative.py --tiny          # tiny shapes (the tests run this)

workloads: the bundled tserve-lm (trained on Shakespeare, Austen and fortunes) on passages of its test split:
  copy      the passage, a blank line, then its first 12 tokens again: a model that copies goes on with the
            passage (what drafts are for: quoting, extraction, edits); this 4M-parameter model copies little,
            and what it keeps is mostly its own repetitions
  continue  the passage alone: ordinary continuation, where drafts mostly fail
  sampled   `copy` at temperature 0.7
each greedy unless said, 64 new tokens; reported: tokens/s with and without speculation, the share of draft
tokens kept, and tokens per step.
step cost: one GPT-2-small-shaped request (random weights, float32 as served) at a 192-token context: the time of
a decode step that feeds 1 token and of one that feeds 1 + k (its next token and a k-token draft). A step is
the time it takes to read the weights, so feeding k more tokens costs little: that ratio bounds the speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass
class Row:
    workload: str
    plain_tps: float
    spec_tps: float
    kept: float  # draft tokens kept / proposed
    tokens_per_step: float


def prompts(loaded, n: int, workload: str) -> list[list[int]]:  # noqa: ANN001
    from training.data import load_lm_corpus

    passages = load_lm_corpus()["test"][:n]
    out = []
    for text in passages:
        ids = loaded.tokenizer.encode(text)[:120]
        if workload in ("copy", "sampled"):
            ids = ids + loaded.tokenizer.encode("\n\n") + ids[:12]
        out.append(ids)
    return out


def timed(loaded, ids: list[list[int]], params, runner) -> tuple[float, int, int, int]:  # noqa: ANN001
    """Seconds for every prompt one at a time; tokens generated, draft tokens proposed and kept."""
    from model.decoding import generate

    tokens = drafted = kept = 0
    start = time.perf_counter()
    for p in ids:
        (seq,) = generate(loaded, [p], params, runner=runner)
        tokens += len(seq.generated)
        drafted, kept = drafted + seq.drafted, kept + seq.accepted
    return time.perf_counter() - start, tokens, drafted, kept


def workloads(loaded, n: int, new: int, repeats: int) -> list[Row]:  # noqa: ANN001
    from model.decoding import DecoderRunner, SamplingParams, Speculation

    plain = DecoderRunner(loaded, num_slots=1, cuda_graphs=False)
    spec = DecoderRunner(loaded, num_slots=1, cuda_graphs=False, speculation=Speculation())
    rows = []
    for workload in ("copy", "continue", "sampled"):
        ids = prompts(loaded, n, workload)
        params = SamplingParams(max_tokens=new, temperature=0.7 if workload == "sampled" else 0.0, seed=0,
                                ignore_eos=True)
        times = {"plain": [], "spec": []}
        for _ in range(repeats):  # alternating, best of each
            for name, runner in (("plain", plain), ("spec", spec)):
                seconds, tokens, drafted, kept = timed(loaded, ids, params, runner)
                times[name].append(seconds)
        steps = tokens - kept  # each step yields its kept draft + 1
        rows.append(Row(workload, tokens / min(times["plain"]), tokens / min(times["spec"]),
                        kept / max(drafted, 1), tokens / max(steps, 1)))
    return rows


def step_costs(directory: Path, context: int, drafts: tuple[int, ...], repeats: int) -> list[tuple[int, float]]:
    """(tokens fed, ms) of one request's decode step at `context` positions."""
    import torch

    from model import checkpoint
    from model.decoding import DecoderRunner, SamplingParams, Speculation, TextSequence

    loaded = checkpoint.load(directory, device="cpu", pack_weights=True)
    runner = DecoderRunner(loaded, num_slots=1, cuda_graphs=False, speculation=Speculation(num_tokens=max(drafts)))
    seq = TextSequence([(7 * i + 3) % 200 + 10 for i in range(context)], SamplingParams(max_tokens=64), "cpu")
    assert runner.admit(seq)
    out = []
    with torch.inference_mode():
        runner.prefill([seq])
        seq.next_token = 11
        for k in (0, *drafts):
            runner.grow(seq, k)
            draft = [12 + j for j in range(k)]
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(8):
                    if k:
                        runner.decode_ahead([seq], [draft])
                    else:
                        runner.model.decode_step(torch.tensor([11]), torch.tensor([seq.num_computed]), runner.cache,
                                                 torch.tensor([seq.slot]), kv_len=seq.num_computed + 1)
                best = min(best, (time.perf_counter() - start) / 8)
            out.append((1 + k, best * 1000))
    runner.release(seq)
    return out


def main(argv: list[str] | None = None) -> tuple[list[Row], list[tuple[int, float]]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    from model import checkpoint
    from training.common import cpu_name

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="tserve-bench-spec-"))
    if args.tiny:
        from bench.load import make_checkpoint

        lm_path, shape = ROOT / "models" / "tserve-lm", make_checkpoint("tiny", work / "tiny")
        args.prompts, args.new, args.repeats, context = 2, 12, 1, 24
    else:
        from bench.roofline import make_gpt2_small

        lm_path, shape, context = ROOT / "models" / "tserve-lm", make_gpt2_small(work / "gpt2-small"), 192
    loaded = checkpoint.load(lm_path, device="cpu", pack_weights=True)
    rows = workloads(loaded, args.prompts, args.new, args.repeats)
    costs = step_costs(shape, context, (1, 2, 4), max(args.repeats, 3))
    print(f"\nCPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; one client, "
          f"{args.prompts} prompts, {args.new} new tokens each, best of {args.repeats}\n")
    print("| workload | tokens/s plain | tokens/s speculative | speed-up | drafts kept | tokens per step |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.workload} | {r.plain_tps:.1f} | {r.spec_tps:.1f} | {r.spec_tps / r.plain_tps:.2f}x | "
              f"{r.kept:.0%} | {r.tokens_per_step:.2f} |")
    base = costs[0][1]
    print(f"\nStep cost, GPT-2 small shape, {context}-token context:\n\n| tokens fed | ms/step | x one token |\n|---|---|---|")
    for fed, ms in costs:
        print(f"| {fed} | {ms:.2f} | {ms / base:.2f} |")
    print(f"\n(median of the speed-ups: {statistics.median(r.spec_tps / r.plain_tps for r in rows):.2f}x)")
    return rows, costs


if __name__ == "__main__":
    main()
