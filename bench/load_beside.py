"""Loading a model beside serving: the inter-token latency of a model being served, before and while another
model (about 500 MB of float32 weights, random) loads through the repository API.

    python bench/load_beside.py                    # tserve-lm streams, a ~540 MB decoder loads
    python bench/load_beside.py --layers 4         # a smaller one

One client streams greedy completions of tserve-lm back to back and records the time between tokens; after a
baseline of --baseline seconds, `POST /v2/repository/models/big/load` is sent and the stream goes on until the
load has answered. Reported: median, p99 and largest gap between tokens in each phase, and their ratio."""

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


def big_checkpoint(d: Path, layers: int) -> int:
    import torch

    from tserve.model.checkpoint import save_checkpoint
    from tserve.model.config import DecoderConfig
    from tserve.model.decoder import Decoder
    from tserve.testing.checkpoints import write_bpe_tokenizer

    write_bpe_tokenizer(d)
    cfg = DecoderConfig(vocab_size=32000, d_model=1024, n_heads=16, d_ff=4096, n_layers=layers, max_seq_len=512,
                        tie_embeddings=False)
    with torch.no_grad():
        model = Decoder(cfg)
    save_checkpoint(d, model)
    return (d / "model.safetensors").stat().st_size


async def stream_gaps(url: str, until: asyncio.Event, gaps: list[float]) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        while not until.is_set():
            body = {"model": "lm", "prompt": "The king said", "max_tokens": 64, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            last = None
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now


def summary(gaps: list[float]) -> tuple[float, float, float]:
    ordered = sorted(gaps)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))], ordered[-1]


async def run(url: str, baseline_s: float) -> tuple[list[float], list[float], float]:
    before, during = [], []
    stop_before, stop_during = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(stream_gaps(url, stop_before, before))
    await asyncio.sleep(baseline_s)
    stop_before.set()
    await task
    task = asyncio.create_task(stream_gaps(url, stop_during, during))
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        resp = await client.post(url + "/v2/repository/models/big/load")
    load_s = time.perf_counter() - start
    stop_during.set()
    await task
    resp.raise_for_status()
    return before, during, load_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--baseline", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    root = scratch_dir(None, "tserve-bench-")
    size = big_checkpoint(root / "repo" / "big", args.layers)
    srv = ServerProcess(["--model", f"lm={ROOT / 'models' / 'tserve-lm'}", "--model-repository", str(root / "repo")],
                        root / "server.log", env={"OMP_NUM_THREADS": str(args.threads)})
    try:
        srv.wait_ready()
        before, during, load_s = asyncio.run(run(srv.url, args.baseline))
    finally:
        srv.stop()
    print(f"CPU: {cpu_name()}, {args.threads} threads; tserve-lm streaming while a {size / 1e6:.0f} MB checkpoint "
          f"loads ({load_s:.1f} s)")
    print("| phase | tokens | median gap (ms) | p99 (ms) | largest (ms) |")
    print("|---|---|---|---|---|")
    rows = [("before", summary(before), len(before)), ("while loading", summary(during), len(during))]
    for name, (med, p99, top), n in rows:
        print(f"| {name} | {n} | {med * 1000:.1f} | {p99 * 1000:.1f} | {top * 1000:.1f} |")
    (m0, p0, t0), (m1, p1, t1) = rows[0][1], rows[1][1]
    print(f"| ratio | | {m1 / m0:.2f}x | {p1 / p0:.2f}x | {t1 / t0:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
