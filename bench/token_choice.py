"""A decoder step's token choice after the output layer, alone: the full path (log_softmax over (rows, V), the
constraints, then topk or argmax) against the raw logits' top tokens (`top_tokens`), on a
step's logits of NLLB-200's vocabulary (256,206) or opus-mt's (15,900).

    python bench/token_choice.py                      # NLLB's vocabulary, 32 requests: greedy and 4 beams
    python bench/token_choice.py --vocab 15900 --banned 1

Prints milliseconds per step (each way's best of --repeats turns, wall and CPU time) and the median of the
turns' ratios (full / top tokens: above 1, the top tokens are faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU time (both threads) of one call, in ms."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - start) * 1e3, (time.process_time() - start_cpu) * 1e3


def compare(full: Callable[[], object], raw: Callable[[], object], repeats: int) -> dict[str, float]:
    """Both ways in turns (the order swapped every turn, so that a shared machine's drifting load moves them
    alike): each way's best wall and CPU time, and the median of the turns' wall-time ratios."""
    full(), raw()
    runs: dict[str, list[tuple[float, float]]] = {"full": [], "raw": []}
    for turn in range(repeats):
        for name, fn in (("full", full), ("raw", raw))[:: 1 if turn % 2 else -1]:
            runs[name].append(timed(fn))
    ratios = [f[0] / r[0] for f, r in zip(runs["full"], runs["raw"], strict=True)]
    return {"full": min(w for w, _ in runs["full"]), "full_cpu": min(c for _, c in runs["full"]),
            "raw": min(w for w, _ in runs["raw"]), "raw_cpu": min(c for _, c in runs["raw"]),
            "ratio": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> None:
    import torch

    from tserve.model.decoding.logits import LogitsPipeline
    from tserve.model.decoding.params import SamplingParams
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=256_206)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--banned", type=int, default=0, help="banned ids of the checkpoint (Marian: 1, its pad)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    class Row:
        params = SamplingParams(max_tokens=64, temperature=0.0)
        num_generated = 5

    pipeline = LogitsPipeline(2, list(range(3, 3 + args.banned)))
    print(f"vocabulary {args.vocab}, {args.requests} requests, {args.threads} threads, banned ids {args.banned}; "
          "ms per step")
    for beams in (1, args.beams):
        n = args.requests * beams
        logits = torch.randn(n, args.vocab) * 3
        t = compare(*step_choices(pipeline, logits, beams, [Row()] * n), args.repeats)
        print(f"  {'greedy' if beams == 1 else f'{beams} beams'} ({n} rows): full log-softmax path {t['full']:.1f} ms "
              f"(CPU {t['full_cpu']:.1f}), top tokens {t['raw']:.1f} ms (CPU {t['raw_cpu']:.1f}); "
              f"median ratio of {args.repeats} turns {t['ratio']:.2f}x")


def step_choices(pipeline, logits, beams: int, rows: list) -> tuple[Callable[[], object], Callable[[], object]]:  # noqa: ANN001
    """The step's choice as the runner took it before (log_softmax over the rows, the constraints, then argmax
    or each beam's top-k) and as it takes it now."""
    import torch

    from tserve.model.decoding.top_tokens import beam_candidates, greedy_tokens

    places = list(range(logits.size(0)))
    index = torch.tensor(places)
    if beams == 1:
        def full() -> object:
            log_probs = torch.log_softmax(logits[index].float(), dim=-1)
            tokens = pipeline.constrain(logits[index], rows).argmax(dim=-1)
            return tokens, log_probs.gather(1, tokens[:, None])[:, 0]

        return full, lambda: greedy_tokens(pipeline, logits, places, rows)

    def full_beams() -> object:
        return torch.topk(pipeline.constrain(torch.log_softmax(logits[index].float(), dim=-1), rows), 2 * beams, -1)

    return full_beams, lambda: beam_candidates(pipeline, logits, places, rows, 2 * beams)


if __name__ == "__main__":
    main()
