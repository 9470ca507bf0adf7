"""The newer language-model families at their published shapes, tserve beside `transformers` on the same
weights: one greedy request, a decode step's time (bench/roofline.py's measure: (t(prompt + N tokens) - t(prompt +
1 token)) / (N - 1), best of `--repeats`, taken in turns), 2 threads each, same run.

    python bench/families.py                          # gemma3-270m, phi4-mini (15 GB of float32 weights)
    python bench/families.py --shapes gemma3-270m --repeats 5

Random weights in each family's published shape (from its config.json on the hub: Gemma 3 270M, Phi-4-mini), so
the model computes exactly what the real one does per token; the tokenizer files are a test fixture's (the
benchmark feeds token ids). tserve runs float32 and int8; `transformers` float32 with eager attention.
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.roofline import hf_step_ms, step_ms  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

_GEMMA3_270M = dict(vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                    sliding_window=512, max_position_embeddings=32_768, sliding_window_pattern=6,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
_PHI4_MINI = dict(vocab_size=200_064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                  num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131_072,
                  original_max_position_embeddings=4096, partial_rotary_factor=0.75, sliding_window=262_144,
                  tie_word_embeddings=True)
SHAPES = {
    "gemma3-270m": ("Gemma3TextConfig", _GEMMA3_270M),
    "phi4-mini": ("Phi3Config", _PHI4_MINI),
    # The tests' stand-ins: the same families, a few hundred thousand weights.
    "tiny-gemma3": ("Gemma3TextConfig", dict(_GEMMA3_270M, vocab_size=512, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=3, head_dim=32, sliding_window=8,
                                             sliding_window_pattern=3, max_position_embeddings=256)),
    "tiny-phi3": ("Phi3Config", dict(_PHI4_MINI, vocab_size=512, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256, original_max_position_embeddings=64,
                                     sliding_window=512)),
}


@dataclass
class Row:
    shape: str
    fmt: str
    ms_per_step: float
    hf_ms_per_step: float

    @property
    def vs_hf(self) -> float:
        return self.hf_ms_per_step / self.ms_per_step


def _longrope(cfg: dict) -> dict:
    """Phi-4-mini's rope scaling: LongRoPE over the rotated 3/4 of each head (its factors' values do not change
    the work of a step; these rise from 1 as the published ones do)."""
    pairs = int(cfg["hidden_size"] // cfg["num_attention_heads"] * cfg["partial_rotary_factor"]) // 2
    return {"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": cfg["partial_rotary_factor"],
            "original_max_position_embeddings": cfg["original_max_position_embeddings"],
            "short_factor": [1.0 + i / pairs for i in range(pairs)],
            "long_factor": [1.0 + 4.0 * i / pairs for i in range(pairs)]}


def make_checkpoint(shape: str, directory: Path) -> Path:
    """A `save_pretrained` directory of `shape` with random weights (kept: a second run reuses it)."""
    import torch
    import transformers

    from tserve.testing.checkpoints import copy_tokenizer_and_config

    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return directory
    config_class, fields = SHAPES[shape]
    fields = dict(fields)
    if config_class == "Phi3Config":
        fields["rope_parameters"] = _longrope(fields)
    copy_tokenizer_and_config(ROOT / "tests" / "fixtures" / "hf-qwen2", directory)
    (directory / "config.json").unlink()
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(directory)
    del model
    gc.collect()
    return directory


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gemma3-270m", "phi4-mini"], choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="the tests' stand-ins, briefly")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--work", default=None, help="where the checkpoints are written (kept for the next run)")
    args = ap.parse_args(argv)
    if args.tiny:
        # 208 steps measured, best of 5 (the stand-ins hold 256 positions): with fewer (32, then 96 of 3 were), a tiny
        # model's fused float32 steps (tens of µs each, a few ms all told) could sum to less than the noise of the
        # one-token run
        args.shapes, args.repeats, args.prompt, args.new = ["tiny-gemma3", "tiny-phi3"], 5, 16, 209
    import torch

    from tserve.model import checkpoint
    from tserve.training.common import cpu_name

    torch.set_num_threads(args.threads)
    work = scratch_dir(args.work, "tserve-bench-families-")
    rows = []
    for shape in args.shapes:
        directory = make_checkpoint(shape, work / shape)
        hf_ms = hf_step_ms(directory, args.prompt, args.new, args.repeats)
        gc.collect()
        for fmt in ("float32", "int8"):
            loaded = checkpoint.load(directory, device="cpu", quantize=fmt if fmt == "int8" else "none",
                                     pack_weights=True, fused_layers=True)
            rows.append(Row(shape, fmt, step_ms(loaded, args.prompt, args.new, args.repeats), hf_ms))
            del loaded
            gc.collect()
    print(f"\nCPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; one greedy "
          f"request, {args.prompt}-token prompt, {args.new - 1} steps measured, best of {args.repeats}\n")
    print("| shape | tserve weights | tserve ms/step | transformers float32 ms/step | x transformers |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.shape} | {r.fmt} | {r.ms_per_step:.2f} | {r.hf_ms_per_step:.2f} | {r.vs_hf:.2f} |")
    return rows


if __name__ == "__main__":
    main()
