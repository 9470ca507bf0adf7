"""llama.cpp as the yardstick for CPU decoding: one greedy request on the same weights, tserve in float32, int8,
q8_0, int4 and q4_0 beside llama.cpp in f32, Q8_0 and Q4_0, 2 threads each, same run.

    python bench/llama_cpp.py --llama-cpp-src DIR --llama-python PY

llama.cpp is not a dependency of tserve: PY is a Python with `llama-cpp-python` installed (built from its
source distribution: 16 minutes on the 2-core machine), DIR the `vendor/llama.cpp` tree of that distribution
(its `convert_hf_to_gguf.py` and `gguf-py`). The weights are GPT-2 small and SmolLM2-135M shapes with random
weights (`bench/roofline.py`'s makers), converted to GGUF f32 by llama.cpp's own converter (the pre-tokenizer
named: the benchmark feeds token ids), then quantized by `llama_model_quantize`. A decode step is
(t(prompt + 65 tokens) - t(prompt + 1 token)) / 64 with a 128-token prompt, best of 3, on both sides.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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


def to_gguf(directory: Path, src: Path, work: Path) -> Path:
    """llama.cpp's converter on a copy of the checkpoint (GPT-2's converter reads `n_ctx`)."""
    copy = work / (directory.name + "-hf")
    if not copy.exists():
        shutil.copytree(directory, copy)
        config = json.loads((copy / "config.json").read_text())
        config.setdefault("n_ctx", config.get("n_positions", 1024))
        (copy / "config.json").write_text(json.dumps(config))
    out = work / f"{directory.name}-f32.gguf"
    subprocess.run([sys.executable, "-c", CONVERT, str(src), str(copy), "--outfile", str(out), "--outtype", "f32"],
                   check=True, capture_output=True)
    return out


def main(argv: list[str] | None = None) -> list[tuple[str, str, float, str, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-src", required=True, type=Path)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=65)
    ap.add_argument("--work", default=None)
    args = ap.parse_args(argv)
    import torch

    from bench.load import make_checkpoint
    from bench.roofline import make_gpt2_small, step_ms
    from tserve.model import checkpoint
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="tserve-bench-llama-cpp-"))
    rows = []
    for size in ("gpt2-small", "smollm2-135m"):
        directory = make_gpt2_small(work / size) if size == "gpt2-small" else make_checkpoint(size, work / size)
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


if __name__ == "__main__":
    main()
