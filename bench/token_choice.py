"""A decoder step's token choice after the output layer, alone: the full path (log_softmax over (rows, V), the
constraints, then topk or argmax) against the raw logits' top tokens and log-sum-exp (`top_tokens`), on a
step's logits of NLLB-200's vocabulary (256,206) or opus-mt's (15,900).

    python bench/token_choice.py                      # NLLB's vocabulary, 32 requests: greedy and 4 beams
    python bench/token_choice.py --vocab 15900 --banned 1

Prints milliseconds per step (best of --repeats) and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


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
          f"ms per step (best of {args.repeats})")
    for beams in (1, args.beams):
        n = args.requests * beams
        logits = torch.randn(n, args.vocab) * 3
        full_ms, raw_ms = (best_ms(fn, args.repeats) for fn in step_choices(pipeline, logits, beams, [Row()] * n))
        print(f"  {'greedy' if beams == 1 else f'{beams} beams'} ({n} rows): full log-softmax path {full_ms:7.1f} ms, "
              f"top tokens + log-sum-exp {raw_ms:7.1f} ms: {full_ms / raw_ms:.1f}x")


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
