"""The event loop's work per streamed token: `/v1/completions` with `stream: true`, N requests at once, through the
whole application in-process (its ASGI app called directly: no sockets, no HTTP client in the loop).

    python bench/stream_overhead.py                          # 1, 8 and 64 requests, 3 rounds
    python bench/stream_overhead.py --batches 64 --tokens 128 --rounds 5

A GPT-2 of one layer of width 32 keeps the model's share small, as in `bench/engine_overhead.py`. Reported per
round: output tokens a second, and the CPU time of the event loop's thread a token (the routes, the served model's
event streams, detokenization, SSE rendering; a web server's socket writes come on top) and of the engine's
thread a token (its steps, the model included). On a GPU the loop runs beside the engine's thread and takes turns
with it on the interpreter lock: at many requests its time a token is what bounds tokens a second over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root
from bench.engine_overhead import tiny_lm  # noqa: E402 - after the path above
from bench.scratch import scratch_dir  # noqa: E402


def _scope(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}


async def _stream(app, body: bytes) -> tuple[int, int]:  # noqa: ANN001 - an ASGI app
    """One streamed request through the app; (status, SSE data lines received)."""
    sent, never = [False], asyncio.Event()
    status, lines = [0], [0]

    async def receive() -> dict:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            lines[0] += message.get("body", b"").count(b"data: ")

    await app(_scope(body), receive, send)
    return status[0], lines[0]


def engine_thread_time() -> float:
    """CPU seconds of the engine's worker threads so far (every thread but this one, on Linux)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(stat[11]) + int(stat[12])) / 100.0  # utime + stime, clock ticks
    return total


async def _run(app, batches: list[int], tokens: int, rounds: int) -> list[dict]:  # noqa: ANN001
    rows = []
    async with app.router.lifespan_context(app):
        registry = app.state.registry
        while not registry.ready:
            await asyncio.sleep(0.05)
        warm = json.dumps({"model": "lm", "prompt": "a b c", "max_tokens": 8, "stream": True}).encode()
        await asyncio.gather(*(_stream(app, warm) for _ in range(max(batches))))
        for batch in batches:
            for r in range(rounds):
                bodies = [json.dumps({"model": "lm", "prompt": f"{i} {r} the quick brown fox", "max_tokens": tokens,
                                      "temperature": 0, "ignore_eos": True, "stream": True}).encode()
                          for i in range(batch)]
                loop_cpu, engine_cpu, start = time.thread_time(), engine_thread_time(), time.perf_counter()
                answers = await asyncio.gather(*(_stream(app, b) for b in bodies))
                wall = time.perf_counter() - start
                loop_cpu, engine_cpu = time.thread_time() - loop_cpu, engine_thread_time() - engine_cpu
                assert all(s == 200 and n >= tokens for s, n in answers), answers
                n = batch * tokens
                rows.append(dict(requests=batch, round=r, tok_s=n / wall, loop_us=loop_cpu / n * 1e6,
                                 engine_us=engine_cpu / n * 1e6))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tserve.service.app import build_app
    from tserve.service.settings import Settings
    from tserve.training.common import cpu_name

    directory = tiny_lm(scratch_dir(None, "tserve-stream-overhead-"))
    settings = Settings(models=[f"lm={directory}"], device="cpu", dtype="float32", log_level="warning",
                        max_running_requests=max(args.batches), max_model_len=args.tokens + 32, cuda_graphs=False)
    rows = asyncio.run(_run(build_app(settings), args.batches, args.tokens, args.rounds))
    print(f"CPU: {cpu_name()}; engine on {args.threads} torch thread(s); {args.tokens} tokens a request\n")
    print("| requests | tokens/s | event loop's CPU a token, µs | engine thread's CPU a token, µs |\n|---|---|---|---|")
    for batch in args.batches:
        mine = [r for r in rows if r["requests"] == batch]
        med = {k: statistics.median(r[k] for r in mine) for k in ("tok_s", "loop_us", "engine_us")}
        print(f"| {batch} | {med['tok_s']:.0f} | {med['loop_us']:.1f} | {med['engine_us']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
