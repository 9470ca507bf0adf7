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
draft model (`--draft-model`): one GPT-2-small-shaped request (random weights, a 192-token prompt of random ids,
64 greedy tokens) without drafts and with k = 4 drafts from each draft model, drafting never paused: the target
as its own draft (every draft kept: the measured ceiling), and GPT-2-shaped drafts of 6 and 2 layers (random
weights: their drafts are almost never kept, so their rows measure what a step with their draft costs). From
the step's cost, the speed-up a draft model would give if a given share of its tokens were kept, and the share
at which drafting breaks even.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.scratch import scratch_dir  # noqa: E402 - after the path above


@dataclass
class Row:
    workload: str
    plain_tps: float
    spec_tps: float
    kept: float  # draft tokens kept / proposed
    tokens_per_step: float


def prompts(loaded, n: int, workload: str) -> list[list[int]]:  # noqa: ANN001
    from tserve.training.data import load_lm_corpus

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
    from tserve.model.decoding import generate

    tokens = drafted = kept = 0
    start = time.perf_counter()
    for p in ids:
        (seq,) = generate(loaded, [p], params, runner=runner)
        tokens += len(seq.generated)
        drafted, kept = drafted + seq.drafted, kept + seq.accepted
    return time.perf_counter() - start, tokens, drafted, kept


def workloads(loaded, n: int, new: int, repeats: int) -> list[Row]:  # noqa: ANN001
    from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation

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

    from tserve.model import checkpoint
    from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation, TextSequence

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


@dataclass
class DraftRow:
    draft: str
    parameters: int
    plain_ms: float  # per token without drafts
    step_ms: float  # per speculative step
    tokens_per_step: float
    kept: float

    @property
    def step_ratio(self) -> float:
        return self.step_ms / self.plain_ms

    def speedup_if_kept(self, share: float, k: int) -> float:
        """Tokens per step when each draft token is kept with probability `share` (until the first miss), over
        the step's cost in plain tokens."""
        expected = k + 1 if share >= 1 else (1 - share ** (k + 1)) / (1 - share)
        return expected / self.step_ratio

    def break_even(self, k: int) -> float:
        low, high = 0.0, 1.0
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if self.speedup_if_kept(mid, k) < 1 else (low, mid)
        return high


def gpt2_draft(directory: Path, layers: int, tiny: bool) -> Path:
    """A GPT-2-shaped draft model of `layers` layers (GPT-2 small's width and vocabulary; the tiny shape's with
    --tiny), random weights, the benchmark target's tokenizer files."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tserve.testing.checkpoints import copy_tokenizer_and_config

    copy_tokenizer_and_config(ROOT / "tests" / "fixtures" / "hf-gpt2", directory)
    torch.manual_seed(layers)
    width = dict(vocab_size=512, n_positions=256, n_embd=64, n_head=4) if tiny else \
        dict(vocab_size=50257, n_positions=1024, n_embd=768, n_head=12)
    GPT2LMHeadModel(GPT2Config(n_layer=layers, **width)).eval().save_pretrained(directory)
    return directory


def draft_model_steps(target: Path, drafts: dict[str, Path], context: int, new: int, k: int,
                      repeats: int) -> list[DraftRow]:
    """One request decoded without drafts and with each draft model's (best of `repeats`, alternating)."""
    from tserve.model import checkpoint
    from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation, generate

    loaded = checkpoint.load(target, device="cpu", pack_weights=True)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(context)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    runners = {"plain": DecoderRunner(loaded, num_slots=1, cuda_graphs=False)}
    sizes = {}
    for name, d in drafts.items():
        draft = checkpoint.load(d, device="cpu", pack_weights=True)
        sizes[name] = draft.num_parameters()
        runners[name] = DecoderRunner(loaded, num_slots=1, cuda_graphs=False, draft=draft,
                                      speculation=Speculation(num_tokens=k, min_acceptance=0.0))
    best = {name: float("inf") for name in runners}
    seqs = {}
    for _ in range(repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            (seqs[name],) = generate(loaded, [prompt], params, runner=runner)
            best[name] = min(best[name], time.perf_counter() - start)
    plain_ms = best["plain"] * 1000 / new
    rows = []
    for name in drafts:
        seq = seqs[name]
        assert seq.generated == seqs["plain"].generated  # the target's own output, whatever the draft
        steps = new - seq.accepted
        rows.append(DraftRow(name, sizes[name], plain_ms, best[name] * 1000 / steps, new / steps,
                             seq.accepted / max(seq.drafted, 1)))
    return rows


def main(argv: list[str] | None = None) -> tuple[list[Row], list[tuple[int, float]], list[DraftRow]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    from tserve.model import checkpoint
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    work = scratch_dir(None, "tserve-bench-spec-")
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
    k = 4
    drafts = {"the target itself": shape} | {f"{n} layers": gpt2_draft(work / f"draft-{n}", n, args.tiny) for n in (6, 2)}
    draft_rows = draft_model_steps(shape, drafts, context, args.new, k, args.repeats)
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
    print(f"\nDraft models, GPT-2 small shape, {context}-token prompt, {args.new} greedy tokens, k = {k}; without drafts "
          f"{draft_rows[0].plain_ms:.2f} ms/token:\n\n| draft model | parameters | drafts kept | tokens per step | ms/step | "
          "step / plain token | speed-up | if 70% kept | if 90% kept | break-even share kept |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in draft_rows:
        print(f"| {r.draft} | {r.parameters / 1e6:.1f}M | {r.kept:.0%} | {r.tokens_per_step:.2f} | {r.step_ms:.2f} | "
              f"{r.step_ratio:.2f} | {r.tokens_per_step / r.step_ratio:.2f}x | {r.speedup_if_kept(0.7, k):.2f}x | "
              f"{r.speedup_if_kept(0.9, k):.2f}x | {r.break_even(k):.2f} |")
    return rows, costs, draft_rows


if __name__ == "__main__":
    main()
