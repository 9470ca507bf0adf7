"""Fair admission under a flood: one client's latency for a request while another client floods the server,
against its latency on an idle server and while the flood comes from its own key (first come, first served).

    python bench/fairness.py                       # tserve-lm, 4 running requests, a flood of 256
    python bench/fairness.py --flood 512 --max-tokens 32 --rows 8

The flood's requests are all queued before the measured request is sent; every request generates
`--max-tokens` tokens (greedy, ignore_eos). Reported: the measured request's latency (median of `--repeats`),
and its ratio to the idle latency."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.scratch import scratch_dir  # noqa: E402 - after the path above
from tserve.testing.server import ServerProcess  # noqa: E402
from tserve.training.common import cpu_name  # noqa: E402


async def one(client: httpx.AsyncClient, url: str, key: str, max_tokens: int, i: int) -> float:
    start = time.perf_counter()
    resp = await client.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={
        "model": "tserve-lm", "prompt": f"The king said {i}", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    resp.raise_for_status()
    return time.perf_counter() - start


async def measured(url: str, key: str, flood_key: str | None, flood: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=flood + 4)) as client:
        floods = [asyncio.ensure_future(one(client, url, flood_key, max_tokens, i)) for i in range(flood)] \
            if flood_key else []
        if floods:
            await asyncio.sleep(0.3)  # the flood is queued (and far from done)
        latency = await one(client, url, key, max_tokens, 999)
        await asyncio.gather(*floods)
        return latency


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="--max-running-requests")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reserved-rows", type=int, nargs="+", default=[0, 1], help="one server per value")
    args = ap.parse_args()
    rows = []
    for reserved in args.reserved_rows:
        log = scratch_dir(None, "tserve-bench-") / "server.log"
        srv = ServerProcess(["--model", f"tserve-lm={ROOT / 'models' / 'tserve-lm'}", "--max-running-requests",
                             str(args.rows), "--max-queue", str(args.flood + 8), "--reserved-rows", str(reserved)],
                            log, env={"TSERVE_API_KEYS": "client-a,client-b", "OMP_NUM_THREADS": str(args.threads)})
        try:
            srv.wait_ready()
            cases = [("flood from its own key (first come, first served)", "client-a", "client-a"),
                     ("flood from another key (clients in turn)", "client-b", "client-a")]
            if not rows:
                cases.insert(0, ("idle server", "client-b", None))
            for name, key, flood_key in cases:
                times = [asyncio.run(measured(srv.url, key, flood_key, args.flood, args.max_tokens))
                         for _ in range(args.repeats)]
                rows.append((name if flood_key is None else f"{name}, --reserved-rows {reserved}",
                             statistics.median(times)))
        finally:
            srv.stop()
    idle = rows[0][1]
    print(f"CPU: {cpu_name()}, {args.threads} threads; tserve-lm, {args.rows} running requests, flood of {args.flood}, "
          f"{args.max_tokens} tokens each, median of {args.repeats}")
    print(f"| {'measured request':<70} | latency (s) | × idle |")
    print(f"|{'-' * 72}|-------------|--------|")
    for name, t in rows:
        print(f"| {name:<70} | {t:11.2f} | {t / idle:6.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
