"""llama.cpp as the yardstick for CPU decoding, on the same weights, 2 threads a side, in two ways.

In process: one greedy request, tserve's runner in float32, int8, q8_0, int4 and q4_0 beside llama.cpp's
`llama-cpp-python` in f32, Q8_0 and Q4_0; a decode step is (t(prompt + 65 tokens) - t(prompt + 1 token)) / 64
with a 128-token prompt, best of 3, on both sides:

    python bench/llama_cpp.py --llama-cpp-src DIR --llama-python PY

Over HTTP: llama.cpp's own `llama-server` against `tserve serve`, 1 client and 8 clients at once (`-np 8` slots),
f32 / Q8_0 / Q4_0 against tserve's float32 / q8_0 / q4_0 (int8 / int4 with --formats):

    python -m tserve.testing.avx2_only bench/llama_cpp.py --llama-server BIN --llama-cpp-src DIR
    python bench/llama_cpp.py --llama-server BIN --llama-cpp-src DIR --tiny     # small shapes, few tokens

llama.cpp is not a dependency of tserve. DIR is the `vendor/llama.cpp` tree of llama-cpp-python's source
distribution (its `convert_hf_to_gguf.py` and `gguf-py`); PY a Python with `llama-cpp-python` built from it (16
minutes on the 2-core machine); BIN its `llama-server` built with CMake (`--llama-quantize`: default the
`llama-quantize` beside it). The weights are GPT-2 small, SmolLM2-135M and Qwen2.5-0.5B shapes with random
weights (`bench/roofline.py`'s and `bench/load.py`'s makers), converted to GGUF f32 by llama.cpp's own converter
(the pre-tokenizer named: both sides are fed the same token ids), then quantized by llama.cpp.

The HTTP runs: C clients each send --requests requests back to back to `/v1/completions` (streaming, greedy,
--max-tokens tokens with `ignore_eos`), every request its own prompt of --prompt tokens: text to tserve, and to
llama-server the token ids tserve's tokenizer makes of it (a check request first makes sure that both count the
same prompt and output tokens). The two servers run in turns, never at once, each warmed up at each client count
first; best of --rounds. Reported per server and format: output tokens/s over the run, ITL p50, and tserve's
tokens/s over llama.cpp's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkpoints come from bench/load.py's makers
from bench.load import Run  # noqa: E402 - after the path above
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""

TIME = """
import ctypes, json, sys, time
import llama_cpp
src, threads, prompt, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = {}
for fmt, ftype in (("f32", 0), ("Q8_0", 7), ("Q4_0", 2)):
    path = src if fmt == "f32" else src.replace("-f32.gguf", "-" + fmt + ".gguf")
    if fmt != "f32":
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, threads
        assert llama_cpp.llama_model_quantize(src.encode(), path.encode(), ctypes.byref(params)) == 0
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                          verbose=False)
    ids = [(7 * i + 3) % 200 + 10 for i in range(prompt)]
    def timed(n):
        best = float("inf")
        for _ in range(3):
            start, got = time.perf_counter(), 0
            for _tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                got += 1
                if got == n:
                    break
            best = min(best, time.perf_counter() - start)
        return best
    timed(8)
    out[fmt] = (timed(new) - timed(1)) / (new - 1) * 1000
    del llm
print(json.dumps(out))
"""

# tserve's formats beside llama.cpp's: q8_0 / q4_0 are llama.cpp's own blocks on our kernels.
PAIRS = (("float32", "f32"), ("int8", "Q8_0"), ("q8_0", "Q8_0"), ("int4", "Q4_0"), ("q4_0", "Q4_0"))
SHAPES = ("gpt2-small", "smollm2-135m", "qwen2.5-0.5b")
TINY_SHAPES = ("tiny", "tiny-llama")


def make_shape(size: str, work: Path) -> Path:
    """The checkpoint of a shape with random weights: GPT-2 small as published, or one of bench/load.py's sizes."""
    from bench.load import make_checkpoint
    from bench.roofline import make_gpt2_small

    return make_gpt2_small(work / size) if size == "gpt2-small" else make_checkpoint(size, work / size)


def to_gguf(directory: Path, src: Path, work: Path) -> Path:
    """llama.cpp's converter on a copy of the checkpoint (GPT-2's converter reads `n_ctx`), once; the copy is
    removed after (Qwen2.5-0.5B's is 2 GB)."""
    out = work / f"{directory.name}-f32.gguf"
    if out.exists():
        return out
    copy = work / (directory.name + "-hf")
    shutil.copytree(directory, copy, dirs_exist_ok=True)
    config = json.loads((copy / "config.json").read_text())
    config.setdefault("n_ctx", config.get("n_positions", 1024))
    (copy / "config.json").write_text(json.dumps(config))
    part = out.with_name(out.name + ".part")  # a conversion cut short is not taken for a file next time
    try:
        subprocess.run([sys.executable, "-c", CONVERT, str(src), str(copy), "--outfile", str(part), "--outtype",
                        "f32"], check=True, capture_output=True)
        part.rename(out)
    finally:
        shutil.rmtree(copy)
    return out


# --------------------------------------------------------------------------------------------------
# Over HTTP: llama-server against tserve serve
# --------------------------------------------------------------------------------------------------
TSERVE_QUANTIZE = {"float32": "none", "int8": "int8", "int4": "int4", "q8_0": "q8_0", "q4_0": "q4_0"}
LLAMA_FORMAT = dict(PAIRS)  # tserve's format -> llama.cpp's file type


@dataclass
class HttpRow:
    model: str
    clients: int
    ours: str  # tserve's format
    theirs: str  # llama.cpp's
    tserve: Run
    llama: Run

    @property
    def ratio(self) -> float:
        return self.tserve.tokens_per_s / self.llama.tokens_per_s if self.llama.tokens_per_s else float("nan")


def quantized(binary: Path, f32: Path, fmt: str, threads: int) -> Path:
    """`llama-quantize` of the f32 file to Q8_0 / Q4_0, once."""
    if fmt == "f32":
        return f32
    out = f32.with_name(f32.name.replace("-f32.gguf", f"-{fmt}.gguf"))
    if not out.exists():
        part = out.with_name(out.name + ".part")
        subprocess.run([str(binary), str(f32), str(part), fmt, str(threads)], check=True, capture_output=True)
        part.rename(out)
    return out


def llama_server_argv(binary: Path, model: Path, port: int, threads: int, slots: int, context: int) -> list[str]:
    """llama-server with `slots` parallel slots of `context` positions each (its -c is the slots' total)."""
    return [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * context), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]


# GCC 12's <amxtileintrin.h> states `_tile_loadconfig` as an asm statement that reads 8 bytes of the 64-byte tile
# configuration, so at -O3 GCC drops the stores of each tile's rows and column bytes before it: palette 1 loads with
# every tile unconfigured, and the first tile instruction raises an illegal instruction. llama.cpp's AMX int8 kernels
# (`ggml-cpu/amx/mmq.cpp`, `ggml_tile_config_init`) take the Q8_0 / Q4_0 products of more than one row, every prompt;
# f32 has none. GCC 13 states it as `__builtin_ia32_ldtilecfg`, which the optimizer sees reading the whole struct.
TILE_CONFIG_AS_8_BYTES = '"m" (*((const void **)__config))'
WITHOUT_AMX = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
               "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
               "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


def cmake_values(cmake_cache: str) -> dict[str, str]:
    """A CMakeCache.txt's `NAME:TYPE=VALUE` lines as {NAME: VALUE}."""
    return {line.split(":", 1)[0]: line.split("=", 1)[1] for line in cmake_cache.splitlines()
            if ":" in line and "=" in line and not line.startswith(("#", "//"))}


def amx_tile_hazard(cmake_cache: str, cpu_flags: set[str], tile_header: str | None) -> str | None:
    """Why this llama.cpp build dies with an illegal instruction on this CPU's first Q8_0 / Q4_0 prompt, or None:
    its AMX int8 kernels are built (GGML_AMX_INT8, or GGML_NATIVE on a CPU with AMX) and run here (the CPU has
    AMX-INT8), at -O3 (a Release build, llama.cpp's default), by a GCC whose `_tile_loadconfig` lets the optimizer
    drop the tile configuration (`tile_header`: that compiler's amxtileintrin.h, None where it has none)."""
    values = cmake_values(cmake_cache)
    on = {name for name, value in values.items() if name.startswith("GGML_") and value == "ON"}
    has_amx = "amx_int8" in cpu_flags
    built = "GGML_AMX_INT8" in on or ("GGML_NATIVE" in on and has_amx)
    optimized = values.get("CMAKE_BUILD_TYPE", "") in ("", "Release")
    if not (built and has_amx and optimized and tile_header and TILE_CONFIG_AS_8_BYTES in tile_header):
        return None
    return ("this llama.cpp build's AMX int8 kernels were compiled at -O3 by a GCC whose _tile_loadconfig lets the "
            "optimizer drop the tile configuration (GCC 12's amxtileintrin.h): its first Q8_0 or Q4_0 prompt dies "
            f"with an illegal instruction. Rebuild without AMX ({WITHOUT_AMX}) or with GCC 13 or clang")


def compiler_tile_header(cmake_cache: str) -> str | None:
    """The amxtileintrin.h of the C++ compiler a CMake cache names (None: no such compiler or header, e.g. clang's)."""
    compiler = cmake_values(cmake_cache).get("CMAKE_CXX_COMPILER")
    if not compiler:
        return None
    try:
        include = subprocess.run([compiler, "-print-file-name=include"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    header = Path(include) / "amxtileintrin.h"
    return header.read_text(errors="replace") if header.is_file() else None


def llama_build(cmake_cache: str) -> str:
    """llama.cpp's CPU build as its CMakeCache.txt has it: `native` (-march=native), else the widest instruction
    sets switched on (`AVX2` for a build held to AVX2; AVX-512 and AMX where it has them)."""
    on = {name for name, value in cmake_values(cmake_cache).items() if name.startswith("GGML_") and value == "ON"}
    if "GGML_NATIVE" in on:
        return "native"
    wide = [name[5:] for name in sorted(on) if name.startswith(("GGML_AVX512", "GGML_AMX"))]
    return " ".join(wide) if wide else "AVX2" if "GGML_AVX2" in on else "unknown"


class LlamaServer:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.url, self.log_file = f"http://127.0.0.1:{port}", log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> LlamaServer:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def prompt_texts(tokenizer, n: int, tokens: int, seed: int = 0) -> list[str]:  # noqa: ANN001
    """n prompts of random words, each the fewest words whose encoding has at least `tokens` ids."""
    import random

    from bench.load import WORDS

    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(tokens)]
        low, high = 1, tokens  # one word is at least one token
        while low < high:
            mid = (low + high) // 2
            if len(tokenizer.encode(" ".join(words[:mid]))) >= tokens:
                high = mid
            else:
                low = mid + 1
        texts.append(" ".join(words[:low]))
    return texts


def request_body(prompt, max_tokens: int, stream: bool, server: str) -> dict:  # noqa: ANN001
    """One `/v1/completions` request: greedy, `max_tokens` tokens whatever is sampled; tserve takes the text,
    llama-server the token ids tserve makes of it. The same request otherwise: neither is asked for logprobs (a
    log-softmax of the vocabulary a token, which only one side would pay). tokens/s counts `max_tokens` a
    request; llama-server sends a chunk every token, tserve one where there is text (`latency_cells`)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if server == "tserve":
        body.update(model="lm")
    return body


async def http_bodies_run(url: str, bodies: list[dict], concurrency: int, name: str) -> Run:
    """`concurrency` clients send the bodies back to back (streaming), each request `max_tokens` tokens."""
    import httpx

    from bench.load import one_request

    run, queue = Run(name, concurrency), list(bodies)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            body = queue.pop(0)
            await one_request(client, f"{url}/v1/completions", body, run)
            run.tokens += body["max_tokens"]

    # A connection per request, on both sides: llama-server (cpp-httplib) now and then dropped a kept-alive
    # connection as the next request went out on it ("Server disconnected without sending a response").
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=1200, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        run.seconds = time.perf_counter() - start
    return run


def counted(url: str, body: dict) -> tuple[int, int]:
    """(prompt tokens, completion tokens) a server reports for one request, not streamed."""
    import httpx

    usage = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=1200).json()["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


def prompt_plan(clients: list[int], requests: int, rounds: int) -> tuple[dict[int, list[range]], int]:
    """Which prompts each client count takes: a warm-up (one a client), then each round's (`requests` a client),
    no prompt twice, so that neither server's prefix cache holds one; and how many prompts that is, with one more
    at the end for the check request."""
    plan, used = {}, 0
    for c in clients:
        plan[c] = [range(used, used + c)] + [range(used + c + r * c * requests, used + c + (r + 1) * c * requests)
                                             for r in range(rounds)]
        used = plan[c][-1].stop
    return plan, used + 1


def server_runs(url: str, server: str, prompts: list, plan: dict[int, list[range]], max_tokens: int) -> dict[int, Run]:
    """The best of the rounds at each client count of `plan` on one running server, after a warm-up at that
    count."""
    best: dict[int, Run] = {}
    for c, (warm, *rounds) in plan.items():
        asyncio.run(http_bodies_run(url, [request_body(prompts[i], 4, True, server) for i in warm], c, server))
        for chosen in rounds:
            bodies = [request_body(prompts[i], max_tokens, True, server) for i in chosen]
            run = asyncio.run(http_bodies_run(url, bodies, c, server))
            if c not in best or run.tokens_per_s > best[c].tokens_per_s:
                best[c] = run
            print(f"{server}, {c} clients: {run.tokens_per_s:.1f} tok/s", file=sys.stderr)
    return best


def http_main(args: argparse.Namespace) -> list[HttpRow]:
    import httpx
    import torch

    from tserve.model.tokenizer import load_tokenizer
    from tserve.testing.server import ServerProcess, port_nobody_else_takes
    from tserve.training.common import cpu_flags, cpu_name

    work = scratch_dir(args.work, "tserve-bench-llama-server-")
    quantize = args.llama_quantize or args.llama_server.with_name("llama-quantize")
    context = args.prompt + args.max_tokens + 64  # positions per slot / request, both sides
    cache = args.llama_server.resolve().parent.parent / "CMakeCache.txt"  # BUILD/bin/llama-server
    cmake_cache = cache.read_text() if cache.exists() else ""
    build, rows = llama_build(cmake_cache) if cmake_cache else "unknown", []
    if hazard := amx_tile_hazard(cmake_cache, cpu_flags(), compiler_tile_header(cmake_cache)):
        raise SystemExit(f"{cache}: {hazard}")
    for size in args.shapes:
        directory = make_shape(size, work)
        f32 = to_gguf(directory, args.llama_cpp_src, work)
        tokenizer = load_tokenizer(directory)
        plan, count = prompt_plan(args.clients, args.requests, args.rounds)
        texts = prompt_texts(tokenizer, count, args.prompt)
        ids = [tokenizer.encode(t) for t in texts]
        for ours in args.formats:
            theirs = LLAMA_FORMAT[ours]
            gguf = quantized(quantize, f32, theirs, args.threads)
            tserve = ServerProcess(["--model", f"lm={directory}", "--quantize", TSERVE_QUANTIZE[ours],
                                    "--max-running-requests", str(max(args.clients)), "--max-model-len",
                                    str(context)], work / f"tserve-{size}-{ours}.log",
                                   env={"OMP_NUM_THREADS": str(args.threads)}).wait_ready(timeout=600)
            try:
                expected = counted(tserve.url, request_body(texts[-1], args.max_tokens, False, "tserve"))
                ours_runs = server_runs(tserve.url, "tserve", texts, plan, args.max_tokens)
            finally:
                tserve.stop()
            theirs_runs = {}
            for c in args.clients:
                port = port_nobody_else_takes()
                llama = LlamaServer(llama_server_argv(args.llama_server, gguf, port, args.threads, c, context), port,
                                    work / f"llama-{size}-{theirs}-{c}.log").wait_ready()
                try:
                    got = counted(llama.url, request_body(ids[-1], args.max_tokens, False, "llama"))
                    if got != expected:
                        raise RuntimeError(f"{size}: tserve counts (prompt, output) tokens {expected}, llama-server "
                                           f"{got}: the two do not serve the same requests")
                    try:
                        theirs_runs.update(server_runs(llama.url, "llama", ids, {c: plan[c]}, args.max_tokens))
                    except httpx.HTTPError as e:  # say how it ended, and where its log is
                        raise RuntimeError(f"llama-server ({theirs}, {c} slots) failed: {e!r}; its exit status "
                                           f"{llama.proc.poll()}; log {llama.log_file}:\n{llama.log()}") from e
                finally:
                    llama.stop()
            rows.extend(HttpRow(size, c, ours, theirs, ours_runs[c], theirs_runs[c]) for c in args.clients)
            print(render_http_table(rows), file=sys.stderr)  # so far: a long run cut short keeps its rows
    print(f"\nCPU: {cpu_name()}; tserve's kernels {torch.backends.cpu.get_cpu_capability()}, llama.cpp's build "
          f"{build}; {args.threads} threads a side; {args.prompt}-token prompts, {args.max_tokens} tokens out, "
          f"greedy, {args.requests} requests a client, best of {args.rounds}\n")
    print(render_http_table(rows))
    return rows


def latency_cells(run: Run) -> str:
    """ITL p50 and TTFT p50 of a run, or "-" for both where its server sent fewer chunks than tokens (tserve
    sends text, and random weights choose ids past the shape tokenizer's vocabulary, which decode to none):
    the gaps between chunks are then not the time a token takes."""
    from bench.load import pct

    if not run.latency or len(run.itl) < run.tokens - len(run.latency):
        return "- | -"
    return f"{1000 * pct(run.itl, 50):.1f} ms | {1000 * pct(run.ttft, 50):.0f} ms"


def render_http_table(rows: list[HttpRow]) -> str:
    lines = ["| model | clients | tserve | tok/s | ITL p50 | TTFT p50 | llama.cpp | tok/s | ITL p50 | TTFT p50 | "
             "tserve / llama.cpp |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.clients} | {r.ours} | {r.tserve.tokens_per_s:.1f} | {latency_cells(r.tserve)} | "
                     f"{r.theirs} | {r.llama.tokens_per_s:.1f} | {latency_cells(r.llama)} | {r.ratio:.2f}x |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# In process: llama-cpp-python against tserve's runner
# --------------------------------------------------------------------------------------------------
def in_process_main(args: argparse.Namespace) -> list[tuple[str, str, float, str, float]]:
    import torch

    from bench.roofline import step_ms
    from tserve.model import checkpoint
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    work = scratch_dir(args.work, "tserve-bench-llama-cpp-")
    rows = []
    for size in args.shapes:
        directory = make_shape(size, work)
        gguf = to_gguf(directory, args.llama_cpp_src, work)
        timed = subprocess.run([args.llama_python, "-c", TIME, str(gguf), str(args.threads), str(args.prompt),
                                str(args.new)], check=True, capture_output=True, text=True)
        llama = json.loads(timed.stdout.strip().splitlines()[-1])
        for ours, theirs in PAIRS:
            loaded = checkpoint.load(directory, device="cpu", quantize=ours if ours != "float32" else "none",
                                     pack_weights=True)
            rows.append((size, ours, step_ms(loaded, args.prompt, args.new, 3), theirs, llama[theirs]))
    print(f"\nCPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads a side; one "
          f"greedy request, {args.prompt}-token prompt, {args.new - 1} steps\n")
    print("| model | tserve | ms/step | llama.cpp | ms/step | tserve / llama.cpp speed |\n|---|---|---|---|---|---|")
    for size, ours, ms, theirs, their_ms in rows:
        print(f"| {size} | {ours} | {ms:.2f} | {theirs} | {their_ms:.2f} | {their_ms / ms:.2f}x |")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-src", required=True, type=Path, help="vendor/llama.cpp of llama-cpp-python's sdist")
    way = ap.add_mutually_exclusive_group(required=True)
    way.add_argument("--llama-python", help="in process: a Python with llama-cpp-python")
    way.add_argument("--llama-server", type=Path, help="over HTTP: llama.cpp's llama-server binary")
    ap.add_argument("--llama-quantize", type=Path, help="llama.cpp's llama-quantize (default: beside llama-server)")
    ap.add_argument("--shapes", nargs="+", choices=[*SHAPES, *TINY_SHAPES], default=None,
                    help=f"default {' '.join(SHAPES)} (in process: the first two); --tiny: {' '.join(TINY_SHAPES)}")
    ap.add_argument("--tiny", action="store_true", help="small shapes, short prompts, few tokens (a smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; --tiny 16)")
    ap.add_argument("--new", type=int, default=65, help="in process: tokens generated (the first is not timed)")
    ap.add_argument("--max-tokens", type=int, default=None, help="over HTTP: tokens a request (default 64; --tiny 8)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="over HTTP: clients at once")
    ap.add_argument("--requests", type=int, default=2, help="over HTTP: requests each client sends in a run")
    ap.add_argument("--rounds", type=int, default=2, help="over HTTP: runs at each client count, the best counts")
    ap.add_argument("--formats", nargs="+", choices=list(TSERVE_QUANTIZE), default=["float32", "q8_0", "q4_0"],
                    help="over HTTP: tserve's formats, each against llama.cpp's nearest (int8, q8_0: Q8_0; "
                         "int4, q4_0: Q4_0)")
    ap.add_argument("--work", default=None, help="directory for checkpoints, GGUF files and logs (default: a new one)")
    args = ap.parse_args(argv)
    if args.shapes is None:
        args.shapes = list(TINY_SHAPES if args.tiny else SHAPES[:2] if args.llama_python else SHAPES)
    if args.prompt is None:
        args.prompt = 16 if args.tiny else 128
    if args.max_tokens is None:
        args.max_tokens = 8 if args.tiny else 64
    if min(args.clients) < 1 or args.requests < 1 or args.rounds < 1:
        ap.error("--clients, --requests and --rounds must be at least 1")
    if args.llama_server and not (args.llama_quantize or args.llama_server.with_name("llama-quantize")).exists():
        ap.error(f"no llama-quantize beside {args.llama_server}: name it with --llama-quantize")
    return args


def main(argv: list[str] | None = None) -> list:
    args = parse_args(argv)
    return http_main(args) if args.llama_server else in_process_main(args)


if __name__ == "__main__":
    main()
