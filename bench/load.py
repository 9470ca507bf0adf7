"""Load test of text generation over HTTP, compared in the same run with Hugging Face `transformers`
`generate` on the same weights.

    python bench/load.py                       # GPT-2 small shape (124M, random weights), 1 and 8 clients
    python bench/load.py --size smollm2-135m   # Llama-family shapes: smollm2-135m, qwen2.5-0.5b
    python bench/load.py --size distil --concurrency 1 4 8 16 --requests 32 --max-tokens 64
    python bench/load.py --url http://host:8000 --model lm --skip-hf   # an already running server

For each concurrency level C, C clients each send requests back to back (streaming, greedy, fixed output
length via ignore_eos), so C requests are always in flight. Reported: output tokens/s over the run,
time to first token (TTFT) and inter-token latency (ITL) percentiles, end-to-end latency; on a CPU, tserve's
fraction of the memory roofline: the bytes a decode step reads (weights as served, the KV cache of C requests
at the middle of their output: `bench/memory_traffic.py`'s count) per ITL p50, over the machine's triad bandwidth
measured in the same run.
The `transformers` baseline serves the same prompts the way a plain pipeline server does: one request at a
time (`hf sequential`), and as static padded batches of C (`hf batch`, which needs all C requests up
front and returns nothing until the whole batch is done).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

FIXTURES = ROOT / "tests" / "fixtures"  # the committed tiny checkpoints, whose tokenizers the random ones take

SIZES = {  # GPT-2 family shapes
    "tiny": {"n_layer": 2, "n_embd": 128, "n_head": 4},
    "distil": {"n_layer": 6, "n_embd": 768, "n_head": 12},
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
}
# Llama-family shapes and vocabularies as the published configs have them (random weights; the prompts are
# tokenized by a small byte-level tokenizer, whose ids all lie inside the real vocabulary). head_dim is given: the
# fixture config a shape starts from may set its own (hf-llama: 16), which would otherwise stay.
FAMILY_SIZES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                                   max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                                   max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256,
                                 tie_word_embeddings=False)),
}
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their its has would more when if no out so said what up").split()


@dataclass
class Run:
    name: str
    concurrency: int
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    of_roofline: float | None = None  # tserve on a CPU: bytes a step reads / ITL p50 / triad bandwidth

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def make_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def make_gpt2(size: str, directory: Path) -> Path:
    """A GPT-2 checkpoint with random weights, the GPT-2 tokenizer files of the committed test fixture hf-gpt2."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tserve.testing.checkpoints import copy_tokenizer_and_config

    if (directory / "model.safetensors").exists():
        return directory
    copy_tokenizer_and_config(FIXTURES / "hf-gpt2", directory)  # vocab.json, merges.txt (the config we overwrite)
    vocab = len(json.loads((directory / "vocab.json").read_text()))
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=1024, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                     **SIZES[size])
    GPT2LMHeadModel(cfg).eval().save_pretrained(directory)
    return directory


def make_family(size: str, directory: Path) -> Path:
    """A Llama-family checkpoint of a published shape, with random weights, the tokenizer and chat template of
    the committed test fixture of its family (hf-llama, hf-mistral, hf-qwen2, hf-qwen3)."""
    import torch
    import transformers

    from tserve.testing.checkpoints import copy_tokenizer_and_config

    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return directory
    family, shape = FAMILY_SIZES[size]
    copy_tokenizer_and_config(FIXTURES / f"hf-{family}", directory)  # and its config, the shape set below
    config = transformers.AutoConfig.from_pretrained(directory)
    for key, value in shape.items():
        setattr(config, key, value)
    if getattr(config, "layer_types", None):  # one entry per layer (Qwen2)
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(directory)
    return directory


def make_checkpoint(size: str, directory: Path) -> Path:
    return make_family(size, directory) if size in FAMILY_SIZES else make_gpt2(size, directory)


# --------------------------------------------------------------------------------------------------
# HTTP side
# --------------------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, body: dict, run: Run) -> None:
    start = time.perf_counter()
    last = None
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            if last is None:
                run.ttft.append(now - start)
            else:
                run.itl.append(now - last)
            last = now
    run.latency.append(time.perf_counter() - start)


async def http_run(url: str, model: str | None, prompts: list[str], concurrency: int, max_tokens: int) -> Run:
    run = Run("tserve (HTTP)", concurrency)
    queue = list(prompts)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            prompt = queue.pop()
            # logprobs=0: every token is its own chunk, even where random weights emit bytes that do not
            # form UTF-8 text yet (the server holds such text back until it is complete).
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "logprobs": 0}
            if model:
                body["model"] = model
            await one_request(client, f"{url}/v1/completions", body, run)
            run.tokens += max_tokens

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        run.seconds = time.perf_counter() - start
    return run


# --------------------------------------------------------------------------------------------------
# transformers side
# --------------------------------------------------------------------------------------------------
def hf_runs(path: Path, prompts: list[str], concurrency: int, max_tokens: int, threads: int,
            device: str, dtype: str, sequential: bool = True) -> list[Run]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def encode(texts: list[str]) -> dict:
        return tok(texts, return_tensors="pt", padding=True).to(device)

    kw = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False,
          "pad_token_id": tok.eos_token_id}
    with torch.inference_mode():
        model.generate(**encode(["warm up"]), **kw)
        runs = []
        if sequential or concurrency == 1:
            seq = Run("hf generate, sequential", concurrency)
            start = time.perf_counter()
            for p in prompts:
                t0 = time.perf_counter()
                model.generate(**encode([p]), **kw)
                sync()
                seq.latency.append(time.perf_counter() - t0)
                seq.tokens += max_tokens
            seq.seconds = time.perf_counter() - start
            runs.append(seq)
        if concurrency > 1:
            batch = Run(f"hf generate, batch of {concurrency}", concurrency)
            start = time.perf_counter()
            for i in range(0, len(prompts), concurrency):
                t0 = time.perf_counter()
                chunk = prompts[i: i + concurrency]
                model.generate(**encode(chunk), **kw)
                sync()
                batch.latency.extend([time.perf_counter() - t0] * len(chunk))
                batch.tokens += max_tokens * len(chunk)
            batch.seconds = time.perf_counter() - start
            runs.append(batch)
    return runs


# --------------------------------------------------------------------------------------------------
def start_server(path: Path, args: argparse.Namespace, log: Path):
    from tserve.testing.server import ServerProcess

    extra = ["--max-running-requests", str(max(args.concurrency) * 2), "--attention-backend", args.backend,
             "--device", args.device, "--dtype", args.dtype, "--quantize", args.quantize]
    return ServerProcess(["--model", f"lm={path}", *extra], log,
                         env={"OMP_NUM_THREADS": str(args.threads)}).wait_ready(timeout=600)


def print_table(runs: list[Run]) -> None:
    header = (f"| {'system':<28} | {'clients':>7} | {'tok/s':>7} | {'TTFT p50':>8} | {'TTFT p95':>8} | "
              f"{'ITL p50':>7} | {'ITL p95':>7} | {'latency p50':>11} | {'of roofline':>11} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in runs:
        ms = lambda v: f"{1000 * v:.0f} ms" if v == v else "-"  # noqa: E731 - NaN prints as '-'
        print(f"| {r.name:<28} | {r.concurrency:>7} | {r.tokens_per_s:>7.1f} | {ms(pct(r.ttft, 50)):>8} | "
              f"{ms(pct(r.ttft, 95)):>8} | {ms(pct(r.itl, 50)):>7} | {ms(pct(r.itl, 95)):>7} | "
              f"{ms(pct(r.latency, 50)):>11} | "
              f"{'-' if r.of_roofline is None else f'{r.of_roofline:.2f}':>11} |")


def print_ratios(runs: list[Run]) -> None:
    """tserve's throughput over the best `transformers` figure at each concurrency."""
    for c in sorted({r.concurrency for r in runs}):
        ours = [r for r in runs if r.concurrency == c and r.name.startswith("tserve")]
        hf = [r for r in runs if r.concurrency == c and r.name.startswith("hf")]
        if ours and hf:
            best = max(hf, key=lambda r: r.tokens_per_s)
            print(f"{c} clients: tserve / {best.name}: {ours[0].tokens_per_s / best.tokens_per_s:.2f}x")


def roofline_fractions(runs: list[Run], path: Path, args: argparse.Namespace, prompt_tokens: int) -> float:
    """Set each tserve run's fraction of the roofline (CPU); returns the triad bandwidth in GB/s."""
    from bench.memory_traffic import bandwidth, step_bytes
    from tserve.model import checkpoint

    triad, _ = bandwidth(args.threads, 512, 3)
    loaded = checkpoint.load(path, device="cpu", dtype=args.dtype, quantize=args.quantize, pack_weights=True)
    weights, kv = step_bytes(loaded, prompt_tokens + args.max_tokens // 2)
    for r in runs:
        if r.name.startswith("tserve") and r.itl:
            r.of_roofline = (weights + r.concurrency * kv) / pct(r.itl, 50) / (triad * 1e9)
    return triad


def main(argv: list[str] | None = None) -> list[Run]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES) + sorted(FAMILY_SIZES), default="small",
                    help="GPT-2 or Llama-family shape to benchmark")
    ap.add_argument("--checkpoint", type=Path, help="a Hugging Face directory instead of random weights")
    ap.add_argument("--url", help="benchmark this running server instead of starting one")
    ap.add_argument("--model", help="model name on --url")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    ap.add_argument("--backend", default="auto", help="attention backend of the server")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (both sides)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="both sides")
    ap.add_argument("--quantize", default="none", choices=["none", "int8"], help="the server's --quantize")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-dtype", choices=["float32", "bfloat16", "float16"],
                    help="transformers' dtype (default --dtype): int8 tserve is compared with float32 transformers")
    ap.add_argument("--hf-sequential", choices=["all", "one-client"], default="all",
                    help="where to run transformers one request at a time: at every concurrency, or at 1 client "
                         "only (a GPU's static batch always beats it above 1 client, and it is the slow part)")
    ap.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = ap.parse_args(argv)

    work = scratch_dir(None, "tserve-bench-")
    prefix = "bench-" if args.size in FAMILY_SIZES else "bench-gpt2-"
    path = args.checkpoint or make_checkpoint(args.size, ROOT / "runs" / f"{prefix}{args.size}")
    server = None if args.url else start_server(path, args, work / "server.log")
    url = args.url or server.url
    runs: list[Run] = []
    try:
        for c in args.concurrency:
            prompts = make_prompts(max(args.requests, c), args.prompt_words, seed=c)
            asyncio.run(http_run(url, args.model, prompts[:c], c, 4))  # warm-up at this batch size
            runs.append(asyncio.run(http_run(url, args.model, prompts, c, args.max_tokens)))
            print(f"tserve, {c} clients: {runs[-1].tokens_per_s:.1f} tok/s", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    if not args.skip_hf:
        for c in args.concurrency:
            prompts = make_prompts(max(args.requests, c), args.prompt_words, seed=c)
            runs.extend(hf_runs(path, prompts, c, args.max_tokens, args.threads, args.device,
                                args.hf_dtype or args.dtype, sequential=args.hf_sequential == "all"))
            print(f"hf, {c}: {runs[-1].tokens_per_s:.1f} tok/s", file=sys.stderr)
    runs.sort(key=lambda r: (r.concurrency, r.name))
    from tserve.training.common import cpu_description

    triad = None
    if args.device == "cpu" and not args.url:
        from tserve.model.tokenizer import load_tokenizer

        prompt_tokens = len(load_tokenizer(path).encode(make_prompts(1, args.prompt_words)[0]))
        triad = roofline_fractions(runs, path, args, prompt_tokens)
    print(f"\nCPU: {cpu_description()}" + (f"; triad bandwidth {triad:.1f} GB/s in this run" if triad else ""))
    print(f"model: {path} ({args.size}), {args.max_tokens} new tokens per request, "
          f"{args.prompt_words}-word prompts, greedy, {args.dtype}, {args.device}, {args.threads} threads, "
          f"server --quantize {args.quantize}, transformers {args.hf_dtype or args.dtype}\n")
    print_table(runs)
    print_ratios(runs)
    if args.out:
        args.out.write_text(json.dumps([{"system": r.name, "clients": r.concurrency, "tokens_per_s": r.tokens_per_s,
                                         "ttft_p50": pct(r.ttft, 50), "itl_p50": pct(r.itl, 50),
                                         "latency_p50": pct(r.latency, 50)} for r in runs], indent=2))
    return runs


if __name__ == "__main__":
    main()
