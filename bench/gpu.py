"""GPU benchmark: tserve against Hugging Face `transformers` on the same random weights, in one run.

    python bench/gpu.py                          # all sections, CUDA, the shapes below
    python bench/gpu.py --sections lm kernels    # a subset
    python bench/gpu.py --tiny --device cpu      # small shapes on CPU: checks the script end to end

Shapes: GPT-2 small (124M, bf16), opus-mt-en-de (74M, fp16), ViT-B/16 (86M, bf16). Our models are built from
the Hugging Face models' own weights (the same importer `tserve` uses for HF checkpoints), so both sides
compute the same function and generate the same number of tokens.

- lm: decode ms/step at batch 1 (HF `generate` vs one request through our engine), and output tokens/s with
  1, 8 and 64 requests at once (HF: one static batch of that size, which needs every request up front; ours:
  the continuous-batching engine with CUDA graphs).
- translation: sentences/s for 32 sentences at once, greedy and 4 beams (HF batched `generate`; ours: the
  translation engine).
- vit: ms per image at batch 1, images/s at batch 256.
- kernels: our flash prefill kernel vs PyTorch SDPA (FlashAttention) and the explicit softmax; our
  flash-decoding kernel vs SDPA over a padded cache, for 64 sequences of mixed lengths.
- device busy: after the timed runs, one more engine run at the largest concurrency (and of the 32 sentences)
  under torch.profiler with CUDA activity: the union of the GPU's kernel, copy and fill intervals over the run's
  wall window (tserve/testing/device_busy.py). A separate run, since the profiler slows the host; without CUDA
  activity the row says why instead of a number.

Prints a table with ratios (ours / HF, or speed-ups) and writes the rows as JSON with --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root

SHAPES = {
    "full": {
        "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
        "marian": dict(d_model=512, layers=6, heads=8, ffn=2048, vocab_size=58101, max_pos=512),
        "vit": dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, num_labels=1000),
        "lm_concurrency": [1, 8, 64], "lm_tokens": 128, "prompt": 32, "mt_batch": 32, "mt_tokens": 64,
        "vit_batches": [1, 256], "prefill_T": [1024, 4096], "decode_L": 2048,
    },
    "tiny": {
        "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128),
        "marian": dict(d_model=32, layers=2, heads=4, ffn=64, vocab_size=500, max_pos=64),
        "vit": dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, num_labels=10),
        "lm_concurrency": [1, 4], "lm_tokens": 8, "prompt": 8, "mt_batch": 4, "mt_tokens": 8,
        "vit_batches": [1, 8], "prefill_T": [64], "decode_L": 128,
    },
}


class Table:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, section: str, what: str, hf: float | None, ours: float, unit: str, higher_is_better: bool,
            baseline: str = "HF transformers", **extra: object) -> None:
        ratio = None if hf is None else (ours / hf if higher_is_better else hf / ours)
        self.rows.append(dict(section=section, what=what, baseline=baseline, baseline_value=hf, tserve=ours,
                              unit=unit, speedup=ratio, **extra))
        base = "-" if hf is None else f"{hf:,.3f}"
        speed = "-" if ratio is None else f"{ratio:.2f}x"
        print(f"| {section} | {what} | {baseline}: {base} | {ours:,.3f} | {unit} | {speed} |", flush=True)

    def busy(self, section: str, what: str, measured: dict, timed_s: float) -> None:
        """A device-busy row: a percentage of the profiled run's wall time, or, where it could not be measured, why.
        `timed_s`, the wall time of the same work unprofiled, gives the other bound: the device's busy seconds over it
        (the profiler slows the host, rarely the device)."""
        if measured.get("busy") is None:
            self.rows.append(dict(section=section, what=what, baseline=None, baseline_value=None, tserve=None,
                                  unit="% of wall time", speedup=None, note=measured["note"]))
            print(f"| {section} | {what} | - | {measured['note']} | % of wall time | - |", flush=True)
            return
        busy_s = measured["busy"] * measured["window_s"]
        self.add(section, what, None, 100.0 * measured["busy"], "% of wall time", True, "-",
                 window_s=measured["window_s"], device_events=measured["device_events"], busy_s=round(busy_s, 4),
                 timed_s=round(timed_s, 4), busy_of_timed_pct=round(100.0 * min(busy_s / timed_s, 1.0), 1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeat: int = 5, warmup: int = 2) -> float:
    """Median wall seconds of `fn` (synchronised)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_requests(engine, submit: Callable[[int], object], n: int) -> tuple[float, int]:
    """Submit n requests at once to a started engine; (seconds until all are done, tokens generated)."""

    async def go() -> int:
        reqs = [submit(i) for i in range(n)]

        async def drain(req) -> int:
            count = 0
            async for event in engine.stream(req):
                count += len(event.token_ids)
            return count

        return sum(await asyncio.gather(*(drain(r) for r in reqs)))

    start = time.perf_counter()
    tokens = asyncio.run(go())
    return time.perf_counter() - start, tokens


class _Stamps:
    """A `generate` streamer that only notes when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_inter_token(hf, ids: torch.Tensor, new: int, pad: int) -> float:
    """Seconds per decode step of HF `generate` at batch 1 (the first put() is the prompt, the second
    the prefill's token; the steps after that are decode steps)."""
    stamps = _Stamps()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=pad, streamer=stamps)
    t = stamps.times
    return (t[-1] - t[1]) / (len(t) - 2)


def engine_inter_token(engine, ids: list[int], params) -> float:
    """Seconds per decode step of one request alone in our engine (time between its streamed tokens)."""

    async def go() -> list[float]:
        times = []
        async for event in engine.stream(engine.submit(ids, params)):
            times += [time.perf_counter()] * len(event.token_ids)
        return times

    t = asyncio.run(go())
    return (t[-1] - t[0]) / (len(t) - 1)


BUSY_WINDOW = "tserve-device-busy-window"  # the record_function range that marks a profiled run's wall window


def device_busy(device: torch.device, run: Callable[[], object]) -> dict:
    """The device's busy fraction over one more call of `run` under torch.profiler: {"busy", "window_s",
    "device_events"}, or {"busy": None, "note": why} where CUDA activity cannot be recorded."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from tserve.testing.device_busy import trace_busy

    if device.type != "cuda":
        return {"busy": None, "note": f"unavailable: no CUDA activity on {device.type}"}
    if ProfilerActivity.CUDA not in torch.profiler.supported_activities():
        return {"busy": None, "note": "unavailable: this torch records no CUDA activity (CUPTI)"}
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function(BUSY_WINDOW):
                run()
            sync(device)
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        try:
            busy, window_s, events = trace_busy(json.loads(path.read_text()), BUSY_WINDOW)
        except LookupError as exc:
            return {"busy": None, "note": f"unavailable: {exc}"}
    return {"busy": busy, "window_s": round(window_s, 4), "device_events": events}


# --------------------------------------------------------------------------------------------------
# Language model
# --------------------------------------------------------------------------------------------------
def lm_checkpoint(name: str, shape: dict, workdir: Path) -> tuple[Path, int, int]:
    """(directory, vocabulary size, eos id) of a random-weight LM: GPT-2 at the run's shape, or a published
    Llama-family shape (bench/load.py's FAMILY_SIZES)."""
    d = workdir / name
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        from tserve.testing.checkpoints import write_bpe_tokenizer

        write_bpe_tokenizer(d)  # ids beyond its vocabulary detokenize to nothing; fine for timing
        g = shape["gpt2"]
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(**g, bos_token_id=g["vocab_size"] - 1,
                                   eos_token_id=g["vocab_size"] - 1)).save_pretrained(d)
        return d, g["vocab_size"], g["vocab_size"] - 1
    from bench.load import make_family

    make_family(name, d)
    config = json.loads((d / "config.json").read_text())
    eos = config.get("eos_token_id")
    return d, config["vocab_size"], eos[0] if isinstance(eos, list) else eos


def bench_lm(shape: dict, device: torch.device, dtype: torch.dtype, workdir: Path, table: Table,
             backend: str, name: str = "gpt2") -> None:
    from transformers import AutoModelForCausalLM

    from tserve.model import checkpoint
    from tserve.model.decoding import SamplingParams
    from tserve.service import heap
    from tserve.service.engine import GenerationEngine
    from tserve.service.metrics import Metrics

    d, vocab, eos = lm_checkpoint(name, shape, workdir)
    section = "lm" if name == "gpt2" else f"lm {name}"
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
    loaded = checkpoint.load(d, device=device, dtype=dtype, backend=backend)
    n_new, plen = shape["lm_tokens"], shape["prompt"]
    gen = torch.Generator().manual_seed(1)

    def prompts(n: int) -> torch.Tensor:
        return torch.randint(0, vocab - 1, (n, plen), generator=gen).to(device)

    def hf_generate(ids: torch.Tensor, new: int) -> None:
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=eos)

    max_c = max(shape["lm_concurrency"])
    engine = GenerationEngine("lm", loaded, max_slots=max_c, max_queue=4 * max_c, max_model_len=None,
                              timeout_s=600.0, metrics=Metrics(), cuda_graphs=device.type == "cuda")
    engine.start()
    try:
        one = prompts(1)
        ids = one[0].tolist()
        params = SamplingParams(max_tokens=n_new + 1, temperature=0.0, ignore_eos=True)
        hf_step = statistics.median(hf_inter_token(hf, one, n_new + 1, eos) for _ in range(3))
        engine_inter_token(engine, ids, params)  # warm-up
        heap.freeze()  # as the server does once its models are ready (--gc-freeze)
        ours_step = statistics.median(engine_inter_token(engine, ids, params) for _ in range(3))
        table.add(section, "decode step, batch 1", hf_step * 1e3, ours_step * 1e3, "ms/step", False)
        for c in shape["lm_concurrency"]:
            batch = prompts(c)
            hf_s = timed(lambda batch=batch: hf_generate(batch, n_new), device, 2, 1)
            rows = batch.tolist()
            params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
            run_requests(engine, lambda i, rows=rows, params=params: engine.submit(rows[i], params), c)
            secs, tokens = run_requests(engine, lambda i, rows=rows, params=params: engine.submit(rows[i], params), c)
            assert tokens == c * n_new, (tokens, c * n_new)
            table.add(section, f"{c} requests at once", c * n_new / hf_s, tokens / secs, "tokens/s", True,
                      "HF static batch" if c > 1 else "HF transformers")
            if c == max_c:  # the goal's figure: how much of the engine's wall time the device works
                measured = device_busy(device, lambda rows=rows, params=params, c=c: run_requests(
                    engine, lambda i: engine.submit(rows[i], params), c))
                table.busy(section, f"device busy at {c} requests", measured, secs)
                if engine.overlap:  # the same requests with every step's tokens read before the next is launched
                    engine.overlap = False
                    try:
                        sync_s, _ = run_requests(engine, lambda i, rows=rows, params=params: engine.submit(
                            rows[i], params), c)
                    finally:
                        engine.overlap = True
                    table.add(section, f"{c} requests at once, --async-scheduling off", c * n_new / hf_s,
                              tokens / sync_s, "tokens/s", True, "HF static batch")
    finally:
        engine.stop()
        heap.thaw()


# --------------------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------------------
def bench_translation(shape: dict, device: torch.device, dtype: torch.dtype, workdir: Path, table: Table,
                      backend: str) -> None:
    from transformers import MarianConfig, MarianMTModel

    from tserve.model import checkpoint
    from tserve.model.decoding import TranslationJob
    from tserve.service import heap
    from tserve.service.engine import TranslationEngine
    from tserve.service.metrics import Metrics
    from tserve.testing.checkpoints import write_marian_tokenizer

    d = workdir / "marian"
    write_marian_tokenizer(d)
    m = shape["marian"]
    pad = m["vocab_size"] - 1
    torch.manual_seed(0)
    cfg = MarianConfig(vocab_size=m["vocab_size"], d_model=m["d_model"], encoder_layers=m["layers"],
                       decoder_layers=m["layers"], encoder_attention_heads=m["heads"],
                       decoder_attention_heads=m["heads"], encoder_ffn_dim=m["ffn"], decoder_ffn_dim=m["ffn"],
                       max_position_embeddings=m["max_pos"], pad_token_id=pad, decoder_start_token_id=pad,
                       eos_token_id=0, forced_eos_token_id=0, activation_function="swish", scale_embedding=True)
    MarianMTModel(cfg).save_pretrained(d)
    hf = MarianMTModel.from_pretrained(d, dtype=dtype).to(device).eval()
    loaded = checkpoint.load(d, device=device, dtype=dtype, backend=backend)
    n, new = shape["mt_batch"], shape["mt_tokens"]
    gen = torch.Generator().manual_seed(2)
    sources = [torch.randint(2, pad, (int(torch.randint(8, 24, (1,), generator=gen)),), generator=gen).tolist() + [0]
               for _ in range(n)]
    width = max(map(len, sources))
    ids = torch.full((n, width), pad, dtype=torch.long)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
    ids, mask = ids.to(device), (ids != pad).long().to(device)
    engine = TranslationEngine("mt", loaded, max_rows=4 * n, max_queue=8 * n, timeout_s=600.0, metrics=Metrics())
    engine.start()
    heap.freeze()  # as the server does once its models are ready (--gc-freeze)
    try:
        for beams in (1, 4):
            def hf_run(beams=beams) -> None:
                with torch.inference_mode():
                    hf.generate(ids, attention_mask=mask, num_beams=beams, max_new_tokens=new, do_sample=False)

            hf_s = timed(hf_run, device, 3, 1)

            def submit(i: int, beams=beams):
                return engine.submit(TranslationJob(sources[i], beams, new))

            run_requests(engine, submit, n)
            secs = statistics.median(run_requests(engine, submit, n)[0] for _ in range(3))
            what = f"{n} sentences, {beams} beam{'s' if beams > 1 else ''}"
            table.add("translation", what, n / hf_s, n / secs, "sentences/s", True)
            table.busy("translation", f"device busy, {what}",
                       device_busy(device, lambda submit=submit: run_requests(engine, submit, n)), secs)
            if beams == 1 and engine.overlap:  # the same sentences with every step read before the next
                engine.overlap = False
                try:
                    sync_s = statistics.median(run_requests(engine, submit, n)[0] for _ in range(3))
                finally:
                    engine.overlap = True
                table.add("translation", f"{what}, --async-scheduling off", n / hf_s, n / sync_s, "sentences/s",
                          True)
    finally:
        engine.stop()
        heap.thaw()


# --------------------------------------------------------------------------------------------------
# ViT
# --------------------------------------------------------------------------------------------------
def bench_vit(shape: dict, device: torch.device, dtype: torch.dtype, workdir: Path, table: Table,
              backend: str) -> None:
    from transformers import ViTConfig, ViTForImageClassification

    from tserve.model import checkpoint

    d = workdir / "vit"
    torch.manual_seed(0)
    ViTForImageClassification(ViTConfig(**shape["vit"])).save_pretrained(d)
    hf = ViTForImageClassification.from_pretrained(d, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    ours = checkpoint.load(d, device=device, dtype=dtype, backend=backend).model
    size = shape["vit"]["image_size"]
    for b in shape["vit_batches"]:
        x = torch.randn(b, 3, size, size, device=device, dtype=dtype)
        with torch.inference_mode():
            hf_s = timed(lambda x=x: hf(pixel_values=x).logits, device, 10, 3)
            our_s = timed(lambda x=x: ours(x), device, 10, 3)
        if b == 1:
            table.add("vit", "batch 1", hf_s * 1e3, our_s * 1e3, "ms", False)
        else:
            table.add("vit", f"batch {b}", b / hf_s, b / our_s, "images/s", True)


# --------------------------------------------------------------------------------------------------
# Attention kernels
# --------------------------------------------------------------------------------------------------
def bench_kernels(shape: dict, device: torch.device, table: Table) -> None:
    import torch.nn.functional as F

    from tserve.model.attention import math_attention, padding_mask
    from tserve.model.kernels.flash import flash_attention, flash_decode

    dtype = torch.bfloat16
    B, H, D = 4, 12, 64
    for T in shape["prefill_T"]:
        q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype) for _ in range(3))
        with torch.inference_mode():
            sdpa = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, 20, 3)
            ours = timed(lambda q=q, k=k, v=v: flash_attention(q, k, v, None, True), device, 20, 3)
            explicit = timed(lambda q=q, k=k, v=v: math_attention(q, k, v, None, True), device, 5, 1)
        table.add("kernels", f"prefill causal T={T}", sdpa * 1e3, ours * 1e3, "ms", False, "SDPA flash")
        table.add("kernels", f"prefill causal T={T}", explicit * 1e3, ours * 1e3, "ms", False, "explicit softmax")
    n, L = 64, shape["decode_L"]
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, L + 1, (n,), generator=gen).to(device)
    k_cache, v_cache = (torch.randn(n, H, L, D, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(n, generator=gen).to(device)
    q = torch.randn(n, H, 1, D, device=device, dtype=dtype)
    mask = padding_mask(lengths, L)

    def padded() -> torch.Tensor:  # what a padded batch does: gather the rows, attend over all L with a mask
        return F.scaled_dot_product_attention(q, k_cache[slots], v_cache[slots], attn_mask=mask)

    with torch.inference_mode():
        sdpa = timed(padded, device, 20, 3)
        ours = timed(lambda: flash_decode(q, k_cache, v_cache, slots[:, None], lengths), device, 20, 3)
    table.add("kernels", f"decode, {n} seqs, lengths 1..{L}", sdpa * 1e3, ours * 1e3, "ms", False,
              "SDPA over padded cache")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a quick end-to-end check, e.g. on CPU)")
    ap.add_argument("--sections", nargs="+", default=["lm", "translation", "vit", "kernels"],
                    choices=["lm", "translation", "vit", "kernels"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "flash", "flash-decode", "math"],
                    help="our models' attention backend")
    ap.add_argument("--lm-shapes", nargs="+", default=["gpt2"],
                    choices=["gpt2", "qwen2.5-0.5b", "smollm2-135m", "tiny-llama"],
                    help="the lm section's models: GPT-2 at the run's shape, or published Llama-family shapes")
    ap.add_argument("--out", default=None, help="write the result rows as JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available here; use --device cpu (with --tiny) to check the script")
    shape = SHAPES["tiny" if args.tiny else "full"]
    half = device.type == "cuda"
    bf16, fp16 = (torch.bfloat16, torch.float16) if half else (torch.float32, torch.float32)
    import transformers

    from tserve.model.attention import resolve_backend

    print(f"device: {torch.cuda.get_device_name(device) if half else 'cpu'}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; attention backend {args.attention_backend} "
          f"({resolve_backend(args.attention_backend, device)})")
    print("| section | what | baseline | tserve | unit | speed-up |\n|---|---|---|---|---|---|")
    table = Table()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "lm" in args.sections:
            for name in args.lm_shapes:
                bench_lm(shape, device, bf16, work, table, args.attention_backend, name)
        if "translation" in args.sections:
            bench_translation(shape, device, fp16, work, table, args.attention_backend)
        if "vit" in args.sections:
            bench_vit(shape, device, bf16, work, table, args.attention_backend)
        if "kernels" in args.sections:
            if device.type != "cuda":
                print("| kernels | skipped: the Triton kernels are timed on CUDA only | | | | |")
            else:
                bench_kernels(shape, device, table)
    if args.out:
        Path(args.out).write_text(json.dumps(table.rows, indent=2))
    return table.rows


if __name__ == "__main__":
    main()
