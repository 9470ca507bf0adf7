"""The paged KV cache, measured: memory by tokens, prefix caching, and decode speed against the static cache.

    python bench/kv_cache.py                              # every part
    python bench/kv_cache.py --parts memory prefix chat
    python bench/kv_cache.py --parts window           # Gemma 3 270M's sliding layers in a pool of their own
    python bench/kv_cache.py --parts decode --baseline-rev f2c02fa --clients 1 8 32

memory: a model with Qwen2.5-0.5B's cache shape (24 layers, 2 kv heads of 64: 24,576 bytes a token in float32)
and a 32k context, --kv-cache-memory of two whole contexts (1.6 GB): requests of 500 tokens (400 prompt, 100
new) sent at once; the most that ran at the same time, against what static per-request slots of the context
admit in the same memory (the budget divided by a context's bytes). Goal: >= 16x.
prefix: 16 requests behind one 1,000-token system prompt, 20 new tokens each, sent at once, on a SmolLM2-135M
shape: TTFT p50 with the prefix cache and with --no-prefix-cache, same run. Goal: >= 5x lower.
translation-memory: the bundled English -> German translator with --kv-cache-memory of 8 static rows (a row's
whole target length and a whole source: what a row cost before its decoder cache and its source's cross-attention
cache came out of one pool) and 512 rows: 128 four-beam requests sent at once; the most beam rows that decoded at
the same time against those 8 rows, and whether every translation equals the one a pool of every row's whole
length gives.
chat: a 6-turn conversation (a 500-token system prompt; each turn adds the previous answer of 40 tokens and
a 60-token user message, as token ids): seconds per turn with and without the prefix cache.
decode: tokens/s of N concurrent greedy requests (200-token prompts, 64 new tokens) on a SmolLM2-135M shape,
and sentences/s of the bundled English -> German translator on 32 sentences, greedy and 4 beams; this tree
against `--baseline-rev` (the static cache), each in a subprocess of its own, alternating, same run. Goal: no
workload slower than 0.95x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEMORY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=24, num_attention_heads=2,
                    num_key_value_heads=2, vocab_size=1024, max_position_embeddings=32768, tie_word_embeddings=True)


class _OldLayout:
    """Imports of `tserve.X` answered by the top-level `X` of a tree from before the one package (the baseline's
    model/ and service/ sat at its root): the same module objects, not copies."""

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001, ANN202
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self) if fullname.startswith("tserve.") else None

    def create_module(self, spec):  # noqa: ANN001, ANN202
        import importlib

        return importlib.import_module(spec.name.removeprefix("tserve."))

    def exec_module(self, module) -> None:  # noqa: ANN001
        pass


def _setup(code_root: Path, threads: int) -> None:
    sys.path.insert(0, str(code_root))
    if not (code_root / "tserve").is_dir():
        import types

        package = types.ModuleType("tserve")
        package.__path__ = []  # a package, so that `tserve.X` is looked up by the finders
        sys.modules["tserve"] = package
        sys.meta_path.insert(0, _OldLayout())
    import torch

    torch.set_num_threads(threads)


def _engine(loaded, **kw):  # noqa: ANN001, ANN202
    from tserve.service.engine import GenerationEngine
    from tserve.service.metrics import Metrics

    engine = GenerationEngine("lm", loaded, metrics=Metrics(), **({"max_queue": 1024, "timeout_s": 3600.0,
                                                                  "cuda_graphs": False} | kw))
    engine.start()
    return engine


async def _stream(engine, prompt: list[int], params) -> tuple[float, int]:  # noqa: ANN001
    """(seconds to the first token, tokens) of one request."""
    start, first, tokens = time.perf_counter(), None, 0
    async for event in engine.stream(engine.submit(prompt, params)):
        if first is None and event.token_ids:
            first = time.perf_counter() - start
        tokens += len(event.token_ids)
    return first or 0.0, tokens


def _model(size: str, directory: Path, shape: dict | None = None):  # noqa: ANN202
    from bench.load import FAMILY_SIZES, make_family
    from tserve.model import checkpoint

    if shape is not None:
        FAMILY_SIZES[size] = ("llama", shape)
    make_family(size, directory)
    return checkpoint.load(directory, device="cpu", dtype="float32")


# --------------------------------------------------------------------------------------------------
def memory_part(work: Path, n: int = 700) -> dict:
    from tserve.model.decoding import SamplingParams

    loaded = _model("qwen2.5-0.5b-cache", work / "memory", MEMORY_SHAPE)
    context, per_token = 32768, 2 * 24 * 2 * 64 * 4
    budget = 2 * context * per_token
    engine = _engine(loaded, max_slots=1024, max_model_len=context, kv_cache_budget=(budget, None))
    peak = {"running": 0, "blocks": 0}
    step = engine.step

    def counting_step() -> None:
        step()
        peak["running"] = max(peak["running"], len(engine.running))
        peak["blocks"] = max(peak["blocks"], engine.runner.blocks.num_in_use)

    engine.step = counting_step
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(400)] for i in range(n)]

    async def go() -> list:
        return await asyncio.gather(*(_stream(engine, p, params) for p in prompts))

    start = time.perf_counter()
    try:
        done = asyncio.run(go())
    finally:
        engine.stop()
    static_rows = budget // (context * per_token)
    return dict(budget=budget, requests=n, finished=sum(t == 100 for _, t in done), peak=peak["running"],
                peak_blocks=peak["blocks"], blocks=engine.runner.blocks.num_usable, static=static_rows,
                ratio=peak["running"] / static_rows, seconds=time.perf_counter() - start,
                preemptions=_metric(engine, "tserve_preemptions_total"))


def window_part(work: Path, shape: str = "gemma3-270m", rows: int = 8, context: int = 32768,
                budget_gib: float = 3.0) -> list[dict]:
    """Gemma 3 270M's shape (15 sliding layers of 512 in 18; `shape`: one of bench/families.py's): the memory of
    `rows` whole contexts, and the whole contexts `budget_gib` holds, with the sliding layers in a pool of their
    own (as served: `lm_kv_blocks`' split) and every layer in the one pool. Sizes only: nothing is allocated."""
    from bench.families import make_checkpoint
    from tserve.model import checkpoint
    from tserve.service.engine.kv_memory import kv_block_bytes, lm_kv_blocks

    directory = work / shape
    if not (directory / "config.json").exists():
        make_checkpoint(shape, directory)
    loaded = checkpoint.load(directory, device="cpu")
    cfg, bs, out = loaded.config, 16, []
    one_pool_block = kv_block_bytes(loaded, bs)
    global_block = kv_block_bytes(loaded, bs, cfg.n_layers - len(cfg.sliding_layers))
    window_block = kv_block_bytes(loaded, bs, len(cfg.sliding_layers))
    whole = rows * -(-context // bs)
    for budget in (None, int(budget_gib * 2**30)):
        if budget is None:  # `rows` whole contexts
            window_blocks = lm_kv_blocks(loaded, (2**40, None), bs, rows, context)[1]
            num_blocks = whole
            budget = num_blocks * global_block + window_blocks * window_block
            one_pool = whole * one_pool_block
        else:
            num_blocks, window_blocks = lm_kv_blocks(loaded, (budget, None), bs, rows, context)
            num_blocks -= 1  # the null block
            one_pool = budget
        out.append(dict(budget=budget, contexts=num_blocks * bs / context, window_blocks=window_blocks,
                        per_token=global_block // bs, one_pool_bytes=one_pool,
                        one_pool_contexts=one_pool // one_pool_block * bs / context,
                        one_pool_per_token=one_pool_block // bs))
    return out


def prefix_part(work: Path, size: str, requests: int = 16, system_tokens: int = 1000,
                new_tokens: int = 20) -> list[dict]:
    from tserve.model.decoding import SamplingParams

    loaded = _model(size, work / size)
    vocab = loaded.config.vocab_size - 1
    system = [1 + (j * 13) % vocab for j in range(system_tokens)]
    prompts = [system + [100 + i, 200 + i, 300 + i, 400 + i, 500 + i] for i in range(requests)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for cached in (False, True):
        engine = _engine(loaded, max_slots=requests, max_model_len=2048, prefix_caching=cached)

        async def go() -> list:
            return await asyncio.gather(*(_stream(engine, p, params) for p in prompts))  # noqa: B023

        try:
            start = time.perf_counter()
            ttft = [t for t, _ in asyncio.run(go())]
            seconds = time.perf_counter() - start
        finally:
            engine.stop()
        rows.append(dict(prefix_cache=cached, ttft_p50=statistics.median(ttft), ttft_max=max(ttft), seconds=seconds,
                         cached_tokens=_metric(engine, "tserve_prefix_cache_cached_tokens_total")))
    return rows


async def _answer(engine, prompt: list[int], params, start: float) -> tuple:  # noqa: ANN001
    """One request's engine request and its seconds from `start` to the first token."""
    req, first = engine.submit(prompt, params), None
    async for event in engine.stream(req):
        if first is None and event.token_ids:
            first = time.perf_counter() - start
    return req, first


def chat_part(work: Path, size: str, turns: int = 6, system_tokens: int = 500) -> list[dict]:
    from tserve.model.decoding import SamplingParams

    loaded = _model(size, work / size)
    vocab = loaded.config.vocab_size - 2
    rows = []
    for cached in (False, True):
        engine = _engine(loaded, max_slots=4, max_model_len=2048, prefix_caching=cached)
        history = [1 + (j * 17) % vocab for j in range(system_tokens)]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        try:
            for turn in range(turns):
                history += [2 + (turn * 61 + j * 29) % vocab for j in range(60)]  # the user's message
                start = time.perf_counter()
                req, first = asyncio.run(_answer(engine, list(history), params, start))
                rows.append(dict(prefix_cache=cached, turn=turn + 1, prompt=len(history), ttft=first,
                                 seconds=time.perf_counter() - start, cached=req.cached_tokens))
                history += req.generated  # the answer goes back in with the next turn
        finally:
            engine.stop()
    return rows


def decode_worker(args: argparse.Namespace) -> None:
    """Run in a subprocess with `--code-root` (this tree or the baseline's): one line of JSON."""
    _setup(Path(args.code_root), args.threads)
    from tserve.model.decoding import SamplingParams

    loaded = _model("smollm2-135m", Path(args.work) / "smollm2")
    n = args.worker_clients
    engine = _engine(loaded, max_slots=max(n, 1), max_model_len=512)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    async def go(run: int) -> list:  # prompts of their own each run: nothing to find in a prefix cache
        prompts = [[1 + (run * 4099 + i * 31 + j * 7) % 40000 for j in range(200)] for i in range(n)]
        return await asyncio.gather(*(_stream(engine, p, params) for p in prompts))

    try:
        asyncio.run(go(0))  # warm-up
        best = 0.0
        for run in range(1, args.repeats + 1):
            start = time.perf_counter()
            tokens = sum(t for _, t in asyncio.run(go(run)))
            best = max(best, tokens / (time.perf_counter() - start))
    finally:
        engine.stop()
    print(json.dumps({"tokens_per_s": best}))


SENTENCES = ("The house is small.", "I would like a cup of coffee, please.", "Where is the train station?",
             "The children are playing in the garden.", "We will meet tomorrow at the old bridge.",
             "My brother reads a book every week.", "The weather was cold and the streets were empty.",
             "Could you tell me the way to the museum?")


def translation_memory_part(n: int = 128, beams: int = 4, static_rows: int = 8) -> dict:
    from tserve.model import checkpoint
    from tserve.model.decoding.seq2seq_runner import row_blocks
    from tserve.service.engine import TranslationEngine
    from tserve.service.engine.kv_memory import kv_block_bytes
    from tserve.service.metrics import Metrics
    from tserve.service.translation.served import collect_translation

    loaded = checkpoint.load(ROOT / "models" / "tserve-en-de", device="cpu", dtype="float32")
    cfg = loaded.config
    budget = static_rows * row_blocks(cfg.max_source_len, cfg.max_target_len, 16) * kv_block_bytes(loaded, 16)
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {SENTENCES[(i * 3 + 1) % len(SENTENCES)]}" for i in range(n)]

    def run(kv_cache_budget: tuple) -> tuple[list, dict, float]:
        engine = TranslationEngine("mt", loaded, max_rows=n * beams, max_queue=1024, timeout_s=3600.0,
                                   metrics=Metrics(), cuda_graphs=False, kv_cache_budget=kv_cache_budget)
        engine.start()
        peak = {"rows": 0, "blocks": 0}
        step = engine.step

        def counting_step() -> None:
            step()
            peak["rows"] = max(peak["rows"], engine.rows_in_use)
            peak["blocks"] = max(peak["blocks"], engine.runner.blocks.num_in_use)

        engine.step = counting_step

        async def go() -> list:
            jobs = [engine.translator.job(t, num_beams=beams, max_tokens=64) for t in texts]
            return await asyncio.gather(*(collect_translation(engine, engine.submit(j)) for j in jobs))

        start = time.perf_counter()
        try:
            results = asyncio.run(go())
        finally:
            engine.stop()
        peak.update(blocks_total=engine.runner.blocks.num_usable,
                    preemptions=_metric(engine, "tserve_preemptions_total"))
        return [r.token_ids for r in results], peak, time.perf_counter() - start

    reference, _, whole_s = run((None, None))
    outputs, peak, seconds = run((budget, None))
    return dict(budget=budget, requests=n, beams=beams, peak_rows=peak["rows"], peak_blocks=peak["blocks"],
                blocks=peak["blocks_total"], static=static_rows, ratio=peak["rows"] / static_rows,
                preemptions=peak["preemptions"], seconds=seconds, whole_seconds=whole_s,
                identical=sum(a == b for a, b in zip(outputs, reference, strict=True)))


def translation_worker(args: argparse.Namespace) -> None:
    """Run in a subprocess with `--code-root`: sentences/s of the bundled English -> German translator, 32
    sentences at once, greedy or 4 beams (`--worker-clients` beams): one line of JSON."""
    _setup(Path(args.code_root), args.threads)
    import torch

    from tserve.model import checkpoint
    from tserve.model.decoding import Seq2SeqRunner, translate

    loaded = checkpoint.load(Path(args.code_root) / "models" / "tserve-en-de", device="cpu", dtype="float32")
    sources = [loaded.tokenizer.encode(SENTENCES[i % len(SENTENCES)]) for i in range(32)]
    beams = args.worker_clients
    runner = Seq2SeqRunner(loaded, num_rows=32 * beams, cuda_graphs=False)  # the engine's: made once
    with torch.inference_mode():
        translate(loaded, sources, beams, 48, runner=runner)  # warm-up
        best = 0.0
        calls = 16 if beams == 1 else 4  # about a second each way
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(calls):
                translate(loaded, sources, beams, 48, runner=runner)
            best = max(best, calls * len(sources) / (time.perf_counter() - start))
    print(json.dumps({"tokens_per_s": best}))


def decode_part(args: argparse.Namespace, work: Path) -> list[dict]:
    baseline = Path(tempfile.mkdtemp(prefix="tserve-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), args.baseline_rev],
                   check=True, capture_output=True)
    rows = []
    try:
        cases = [("lm", n) for n in args.clients if n > 0] + [("translation", 1), ("translation", 4)]
        for worker, clients in cases:
            speeds: dict[str, list[float]] = {"paged": [], "static": []}
            for _ in range(args.rounds):
                for name, tree in (("static", baseline), ("paged", ROOT)):
                    out = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--code-root", str(tree),
                         "--work", str(work), "--worker-clients", str(clients), "--threads", str(args.threads),
                         "--repeats", str(args.repeats)], check=True, capture_output=True, text=True, env=os.environ)
                    speeds[name].append(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])
            paged, static = max(speeds["paged"]), max(speeds["static"])
            what = f"LM, {clients} clients, tokens/s" if worker == "lm" else (
                f"translation, 32 sentences, {'greedy' if clients == 1 else f'{clients} beams'}, sentences/s")
            rows.append(dict(workload=what, static=static, paged=paged, ratio=paged / static))
            print(f"| {what} | {static:.1f} | {paged:.1f} | {paged / static:.2f}x |", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
    return rows


def _metric(engine, name: str) -> float:  # noqa: ANN001
    text = engine.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["memory", "translation-memory", "window", "prefix", "chat", "decode"],
                    choices=["memory", "translation-memory", "window", "prefix", "chat", "decode"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window-shape", default="gemma3-270m", help="window: a shape of bench/families.py")
    ap.add_argument("--window-context", type=int, default=32768)
    ap.add_argument("--window-budget", type=float, default=3.0, help="window: --kv-cache-memory in GiB")
    ap.add_argument("--size", default="smollm2-135m", help="prefix and chat: the model shape (bench/load.py's)")
    ap.add_argument("--memory-requests", type=int, default=700)
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000, help="prefix: the shared prompt; chat: half of it")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="LM client counts (0: none)")
    ap.add_argument("--baseline-rev", default="f2c02fa", help="the static cache's commit (decode part)")
    ap.add_argument("--rounds", type=int, default=2, help="decode: subprocess runs per side, alternating")
    ap.add_argument("--repeats", type=int, default=2, help="decode: timed runs in each subprocess (best kept)")
    ap.add_argument("--work", default=None, help="where the random-weight checkpoints are written (kept)")
    ap.add_argument("--worker", choices=["lm", "translation"], help=argparse.SUPPRESS)
    ap.add_argument("--code-root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--worker-clients", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        (decode_worker if args.worker == "lm" else translation_worker)(args)
        return {}
    _setup(ROOT, args.threads)
    from bench.scratch import scratch_dir
    from tserve.training.common import cpu_description

    work = scratch_dir(args.work, "tserve-kv-")
    print(f"CPU: {cpu_description()}; {args.threads} threads\n", flush=True)
    out: dict = {}
    if "memory" in args.parts:
        r = out["memory"] = memory_part(work, args.memory_requests)
        print("| --kv-cache-memory | requests | finished | most running at once | blocks used (of) | "
              "static slots of 32k | ratio | preemptions | seconds |\n|---|---|---|---|---|---|---|---|---|")
        print(f"| {r['budget'] / 1e9:.2f} GB | {r['requests']} | {r['finished']} | {r['peak']} | "
              f"{r['peak_blocks']} ({r['blocks']}) | {r['static']} | {r['ratio']:.0f}x (goal >= 16x) | "
              f"{r['preemptions']:.0f} | {r['seconds']:.1f} |\n", flush=True)
    if "translation-memory" in args.parts:
        r = out["translation-memory"] = translation_memory_part()
        print("| --kv-cache-memory | requests | most beam rows at once | blocks used (of) | static rows in that "
              "memory | ratio | preemptions | identical to the whole-length pool | seconds (whole-length pool) |\n"
              "|---|---|---|---|---|---|---|---|---|")
        print(f"| {r['budget'] / 1e6:.1f} MB | {r['requests']} x {r['beams']} beams | {r['peak_rows']} | "
              f"{r['peak_blocks']} ({r['blocks']}) | {r['static']} | {r['ratio']:.0f}x | {r['preemptions']:.0f} | "
              f"{r['identical']} of {r['requests']} | {r['seconds']:.1f} ({r['whole_seconds']:.1f}) |\n", flush=True)
    if "window" in args.parts:
        rows = out["window"] = window_part(work, args.window_shape, context=args.window_context,
                                           budget_gib=args.window_budget)
        print(f"{args.window_shape} shape, contexts of {args.window_context}: the sliding layers' own pool (as served) "
              "against every layer in one\n\n| own pool: memory | contexts | bytes a position past the window | "
              "its window pool (blocks) | one pool: memory | contexts | bytes a position |\n|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['budget'] / 2**30:.2f} GiB | {r['contexts']:.2f} | {r['per_token']} | {r['window_blocks']} | "
                  f"{r['one_pool_bytes'] / 2**30:.2f} GiB | {r['one_pool_contexts']:.2f} | {r['one_pool_per_token']} |")
        print(flush=True)
    if "prefix" in args.parts:
        rows = out["prefix"] = prefix_part(work, args.size, args.prefix_requests, args.system_tokens)
        print("| prefix cache | TTFT p50 s | TTFT max s | all done s | cached tokens |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {'on' if r['prefix_cache'] else 'off'} | {r['ttft_p50']:.2f} | {r['ttft_max']:.2f} | "
                  f"{r['seconds']:.1f} | {r['cached_tokens']:.0f} |")
        off, on = rows[0]["ttft_p50"], rows[1]["ttft_p50"]
        print(f"\nTTFT p50 off / on: {off / on:.1f}x (goal >= 5x)\n", flush=True)
    if "chat" in args.parts:
        rows = out["chat"] = chat_part(work, args.size, args.turns, args.system_tokens // 2)
        print("| turn | prompt tokens | off: TTFT s | off: turn s | on: TTFT s | on: turn s | on: cached |\n"
              "|---|---|---|---|---|---|---|")
        half = len(rows) // 2
        for off, on in zip(rows[:half], rows[half:], strict=True):
            print(f"| {off['turn']} | {off['prompt']} | {off['ttft']:.3f} | {off['seconds']:.2f} | {on['ttft']:.3f} | "
                  f"{on['seconds']:.2f} | {on['cached']} |")
        print(flush=True)
    if "decode" in args.parts:
        print(f"static cache ({args.baseline_rev}) vs paged (this tree); LM: SmolLM2-135M shape; translation: "
              "models/tserve-en-de\n\n| workload | static | paged | paged / static |\n|---|---|---|---|", flush=True)
        out["decode"] = decode_part(args, work)
    return out


if __name__ == "__main__":
    main()
