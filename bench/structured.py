"""Structured output: what a grammar costs, measured.

    python bench/structured.py                     # both parts
    python bench/structured.py --parts masks       # mask time per token: llguidance vs outlines-core
    python bench/structured.py --parts engine --requests 16 --max-tokens 96

masks: a 10-field JSON schema compiled for vocabularies of 50k and 150k tokens (GPT-2 / Llama-3 and Qwen sizes;
synthetic byte-level vocabularies, since no hub is reached), then one mask per token along a valid document:
compile time, and the median and 95th-percentile time of a mask, for llguidance (what tserve uses) and
outlines-core (when installed).
engine: the generation engine (continuous batching, in process) on a SmolLM2-135M-shaped model (random
weights, 49,152-token vocabulary) with N concurrent requests, all under the schema or all free, same run:
tokens/s of each. Goal: constrained >= 0.9x free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 12},
        "email": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "city": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 16},
    },
    "required": ["id", "name", "email", "age", "active", "score", "city", "role", "tags", "note"],
    "additionalProperties": False,
}
DOCUMENT = {"id": 4711, "name": "Ada Lovelace", "email": "ada@example.org", "age": 36, "active": True,
            "score": 9.75, "city": "London", "role": "admin", "tags": ["math", "poet"], "note": "first programmer"}


def synthetic_vocabulary(size: int, seed: int = 0) -> list[bytes]:
    """256 single bytes, then words, word pieces with a leading space, digits and JSON punctuation runs, as a
    byte-level BPE vocabulary has them."""
    rng = random.Random(seed)
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    letters, syllables = "abcdefghijklmnopqrstuvwxyz", ["th", "er", "on", "an", "re", "in", "ed", "nd", "ha", "at",
                                                         "en", "es", "of", "or", "nt", "ea", "ti", "to", "it", "st"]
    extras = [b'":', b'","', b'":"', b'},', b'{"', b'"}', b'",', b'":[', b'"]', b"],", b"true", b"false", b"null"]
    for t in extras:
        seen.add(t)
        tokens.append(t)
    while len(tokens) < size:
        kind = rng.random()
        if kind < 0.1:
            word = str(rng.randrange(10 ** rng.randint(1, 4)))
        else:
            word = "".join(rng.choice(syllables) if rng.random() < 0.6 else rng.choice(letters)
                           for _ in range(rng.randint(1, 5)))
            word = (" " if rng.random() < 0.5 else "") + (word.capitalize() if rng.random() < 0.2 else word)
        token = word.encode()
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    return tokens


class _Tokens:
    """What llguidance.TokenizerWrapper reads: the tokens' bytes, eos, and a tokenizer (greedy, longest first)."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens + [b"<eos>"], len(tokens), None
        self.special_token_ids = [len(tokens)]
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._longest = max(len(t) for t in tokens)

    def __call__(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                if (t := self._ids.get(data[i: i + n])) is not None:
                    out.append(t)
                    i += n
                    break
        return out


def time_masks(size: int, steps_doc: bytes) -> list[dict]:
    import llguidance
    import llguidance.torch as llg_torch

    vocab = synthetic_vocabulary(size)
    tokens = _Tokens(vocab)
    walk = tokens(steps_doc)
    rows = []
    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(tokens))
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}), log_level=0)
    compile_ms = (time.perf_counter() - start) * 1e3
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llg_torch.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for t in walk:
        start = time.perf_counter()
        llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        assert (int(bitmask[0, t // 32]) >> (t % 32)) & 1, "the document's token is not allowed"
        matcher.consume_token(t)
    rows.append(dict(library="llguidance", vocab=size, tokenizer_s=tokenizer_s, compile_ms=compile_ms,
                     mask_us_p50=statistics.median(times) * 1e6,
                     mask_us_p95=sorted(times)[int(0.95 * (len(times) - 1))] * 1e6, steps=len(walk)))
    try:
        import outlines_core
    except ImportError:
        return rows
    from outlines_core.json_schema import build_regex_from_schema

    ids: dict[bytes, list[int]] = {}
    for i, tok in enumerate(vocab):
        ids.setdefault(tok, []).append(i)
    start = time.perf_counter()
    oc_vocab = outlines_core.Vocabulary(tokens.eos_token_id, ids)
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), oc_vocab)
    compile_ms = (time.perf_counter() - start) * 1e3
    guide = outlines_core.Guide(index)
    mask = torch.zeros((tokens.eos_token_id + 32) // 32, dtype=torch.int32)
    times = []
    for t in walk:
        start = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        times.append(time.perf_counter() - start)
        guide.advance(t)
    rows.append(dict(library="outlines-core", vocab=size, tokenizer_s=0.0, compile_ms=compile_ms,
                     mask_us_p50=statistics.median(times) * 1e6,
                     mask_us_p95=sorted(times)[int(0.95 * (len(times) - 1))] * 1e6, steps=len(walk)))
    return rows


def engine_throughput(requests: int, max_tokens: int, threads: int, size: str = "smollm2-135m") -> list[dict]:
    """tokens/s of N concurrent requests, all constrained or all free, on a SmolLM2-135M shape (or `size`, one
    of bench/load.py's FAMILY_SIZES)."""
    from bench.load import make_family
    from tserve.model import checkpoint
    from tserve.model.decoding import SamplingParams
    from tserve.model.decoding.structured import Constraint
    from tserve.service.engine import GenerationEngine
    from tserve.service.metrics import Metrics

    torch.set_num_threads(threads)
    d = scratch_dir(None, "tserve-structured-") / size
    make_family(size, d)
    config = json.loads((d / "config.json").read_text())
    eos = config["vocab_size"] - 1
    vocab = synthetic_vocabulary(eos)
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    # A byte-level BPE of the real size: the grammar library sees 49,152 tokens, as with SmolLM2's own.
    byte_chars = _byte_level_chars()
    tokenizer["model"]["vocab"] = {"".join(byte_chars[b] for b in t): i for i, t in enumerate(vocab)}
    tokenizer["model"]["merges"] = []
    tokenizer["added_tokens"] = [{"id": eos, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True}]
    (d / "tokenizer.json").write_text(json.dumps(tokenizer))
    config |= {"eos_token_id": eos, "bos_token_id": eos}
    (d / "config.json").write_text(json.dumps(config))
    (d / "generation_config.json").unlink(missing_ok=True)
    loaded = checkpoint.load(d, device="cpu", dtype="float32")
    engine = GenerationEngine("lm", loaded, max_slots=requests, max_queue=4 * requests, max_model_len=512,
                              timeout_s=600.0, metrics=Metrics(), cuda_graphs=False)
    grammar = engine.runner.grammars.compile(Constraint("json", json.dumps(SCHEMA)))
    prompt = loaded.tokenizer.encode("Give me a user record as JSON:")[:24] or [1, 2, 3]
    engine.start()

    async def one(params: SamplingParams) -> int:
        count = 0
        async for event in engine.stream(engine.submit(prompt, params)):
            count += len(event.token_ids)
        return count

    def run(constrained: bool) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=not constrained,
                                 grammar=grammar if constrained else None) for i in range(requests)]

        async def go() -> list[int]:
            return await asyncio.gather(*(one(p) for p in params))

        start = time.perf_counter()
        tokens = sum(asyncio.run(go()))
        return time.perf_counter() - start, tokens

    rows = []
    try:
        run(True), run(False)  # warm-up
        for constrained in (False, True, False, True):
            seconds, tokens = run(constrained)
            rows.append(dict(constrained=constrained, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds))
    finally:
        engine.stop()
    return rows


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["masks", "engine"], choices=["masks", "engine"])
    ap.add_argument("--vocab-sizes", type=int, nargs="+", default=[50_000, 150_000])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="smollm2-135m", help="the engine part's model shape (bench/load.py's)")
    args = ap.parse_args(argv)
    from tserve.training.common import cpu_name

    print(f"CPU: {cpu_name()}; {args.threads} threads\n")
    out: dict = {}
    if "masks" in args.parts:
        doc = json.dumps(DOCUMENT, separators=(",", ":")).encode()
        out["masks"] = rows = [r for size in args.vocab_sizes for r in time_masks(size, doc)]
        print("| library | vocabulary | compile ms | mask µs p50 | mask µs p95 | tokens walked |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['library']} | {r['vocab']:,} | {r['compile_ms']:.1f} | {r['mask_us_p50']:.0f} | "
                  f"{r['mask_us_p95']:.0f} | {r['steps']} |", flush=True)
    if "engine" in args.parts:
        out["engine"] = rows = engine_throughput(args.requests, args.max_tokens, args.threads, args.size)
        print(f"\n{args.requests} concurrent requests, {args.size} shape, its vocabulary size, sampled\n")
        print("| requests | constraint | tokens | seconds | tokens/s |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {args.requests} | {'10-field JSON schema' if r['constrained'] else 'none'} | {r['tokens']} | "
                  f"{r['seconds']:.2f} | {r['tokens_per_s']:.1f} |", flush=True)
        free = statistics.mean(r["tokens_per_s"] for r in rows if not r["constrained"])
        constrained = statistics.mean(r["tokens_per_s"] for r in rows if r["constrained"])
        out["ratio"] = constrained / free
        print(f"\nconstrained / free: {constrained / free:.2f}x (goal >= 0.9x)")
    return out


if __name__ == "__main__":
    main()
