"""The event loop's work per streamed token: `/v1/completions` with `stream: true`, N requests at once, through the
whole application in-process (its ASGI app called directly: no sockets, no HTTP client in the loop).

    python bench/stream_overhead.py                          # 1, 8 and 64 requests, 3 rounds
    python bench/stream_overhead.py --batches 64 --tokens 128 --rounds 5
    python bench/stream_overhead.py --batches 64 --tokens 96 --rounds 4 --no-gc-freeze   # the heap left unfrozen

The committed tiny language model (tests/fixtures/tiny-lm: two layers of width 64, trained on a short text, so that
its greedy tokens are words and every token's text is rendered; a random model's byte-level tokens rarely finish a
character) keeps the model's share small. Reported, medians of the rounds: output tokens a second, and the CPU time of the event loop's thread a token (the routes, the served model's
event streams, detokenization, SSE rendering; a web server's socket writes come on top) and of the engine's
thread a token (its steps, the model included). On a GPU the loop runs beside the engine's thread and takes turns
with it on the interpreter lock: at many requests its time a token is what bounds tokens a second over HTTP. And SSE
chunks a token: below one where a reader that fell behind got several tokens in one chunk. Last, the garbage
collector's work during the rounds (`--gc-freeze`, on by default as in the server: docs/SETTINGS.md): full
(generation 2) collections, their total and longest pause, and the tokens a second over all rounds, which a pause
that stops every stream lowers (the median round may miss it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root

TINY_LM = ROOT / "tests" / "fixtures" / "tiny-lm"


def _scope(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}


async def _stream(app, body: bytes) -> tuple[int, bool, int]:  # noqa: ANN001 - an ASGI app
    """One streamed request through the app: (status, whether it ran to its length and [DONE], SSE chunks)."""
    sent, never = [False], asyncio.Event()
    status, tail, chunks = [0], [b""], [0]

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
            tail[0] = (tail[0] + message.get("body", b""))[-400:]
            chunks[0] += message.get("body", b"").count(b"data: {")

    await app(_scope(body), receive, send)
    return status[0], b'"finish_reason":"length"' in tail[0] and tail[0].endswith(b"data: [DONE]\n\n"), chunks[0]


def engine_thread_time() -> float:
    """CPU seconds of the other threads so far (the engine's worker among them): each thread's own CPU clock."""
    total = 0.0
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.ident is None:
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ValueError):  # it ended meanwhile
            continue
    return total


class FullCollections:
    """The pauses of the garbage collector's full (generation 2) collections while it is open, in seconds."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._start = time.perf_counter()
            else:
                self.pauses.append(time.perf_counter() - self._start)


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
                with FullCollections() as full:
                    answers = await asyncio.gather(*(_stream(app, b) for b in bodies))
                wall = time.perf_counter() - start
                loop_cpu, engine_cpu = time.thread_time() - loop_cpu, engine_thread_time() - engine_cpu
                assert all(s == 200 and done for s, done, _ in answers), answers
                n = batch * tokens
                rows.append(dict(requests=batch, round=r, tok_s=n / wall, loop_us=loop_cpu / n * 1e6,
                                 engine_us=engine_cpu / n * 1e6, chunks=sum(c for _, _, c in answers) / n,
                                 tokens=n, wall_s=wall, gc_pauses=full.pauses))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--checkpoint", type=Path, default=TINY_LM, help="the language model served")
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="freeze the heap once the model is ready, as the server does (default: on)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tserve.service.app import build_app
    from tserve.service.settings import Settings
    from tserve.training.common import cpu_name

    settings = Settings(models=[f"lm={args.checkpoint}"], device="cpu", dtype="float32", log_level="warning",
                        max_running_requests=max(args.batches), max_model_len=args.tokens + 32, cuda_graphs=False,
                        gc_freeze=args.gc_freeze)
    rows = asyncio.run(_run(build_app(settings), args.batches, args.tokens, args.rounds))
    print(f"CPU: {cpu_name()}; engine on {args.threads} torch thread(s); {args.tokens} tokens a request; heap "
          f"{'frozen' if args.gc_freeze else 'not frozen'} once ready\n")
    print("| requests | tokens/s | event loop's CPU a token, µs | engine thread's CPU a token, µs | SSE chunks a token "
          "| full collections | their pauses, ms (longest) | tokens/s over all rounds |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batches:
        mine = [r for r in rows if r["requests"] == batch]
        med = {k: statistics.median(r[k] for r in mine) for k in ("tok_s", "loop_us", "engine_us", "chunks")}
        pauses = [p for r in mine for p in r["gc_pauses"]]
        overall = sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine)
        print(f"| {batch} | {med['tok_s']:.0f} | {med['loop_us']:.1f} | {med['engine_us']:.1f} | {med['chunks']:.2f} "
              f"| {len(pauses)} | {sum(pauses) * 1e3:.1f} ({max(pauses, default=0) * 1e3:.1f}) | {overall:.0f} |")
    return rows


if __name__ == "__main__":
    main()
