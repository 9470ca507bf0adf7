"""Translation speed against the anchors, in one run on the same weights: Hugging Face `generate`,
CTranslate2 (float32 and int8, converted with its own converter) and tserve over HTTP (float32 and
`--quantize int8`); greedy and 4 beams.

    python bench/translation.py                # opus-mt-en-de shape (d512, 6+6 layers, 8 heads), random weights
    python bench/translation.py --tiny         # tiny shapes, every column, seconds (the tests run this)
    python bench/translation.py --model nllb   # NLLB-200-distilled-600M shape (d1024, 12+12, vocabulary 256,206),
                                               # English -> German with the target language forced

Each system translates the same sentences (18-30 words) to at most --max-tokens target tokens: HF and
CTranslate2 in batches of --batch; tserve as batches of --batch inputs per `/v1/translations` request, and as
--clients concurrent clients sending one sentence each. Reported: generated target tokens per second (each
system's own count of the tokens it produced), and tserve's ratio to CTranslate2 of the same precision.
CTranslate2 and tserve (both its servers up at once) take --rounds turns, the order reversed every other round:
each row is a system's median round, and each round's ratios are printed under the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

SHAPES = {
    "opus-mt": dict(d_model=512, layers=6, heads=8, ffn=2048, vocab=15_900, max_pos=512),
    "nllb": dict(d_model=1024, layers=12, heads=16, ffn=4096, vocab=256_206, max_pos=1024),
    "tiny": dict(d_model=32, layers=2, heads=4, ffn=64, vocab=400, max_pos=256),
}
SOURCE, TARGET = "eng_Latn", "deu_Latn"  # NLLB: every system encodes the source in English and forces German
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their its has would more when if no out so said what up "
         "house tree water morning friend train book city river small old new good long").split()


@dataclass
class Row:
    system: str
    beams: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def make_marian(shape: dict, d: Path) -> Path:
    """A Marian checkpoint of `shape` with random weights; tserve.testing's opus-mt tokenizer files, the
    vocabulary padded to the shape's size so that the output layer costs what the real one does."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    from tserve.testing.checkpoints import write_marian_tokenizer

    vocab = write_marian_tokenizer(d)
    del vocab["<pad>"]  # opus-mt's layout: <pad> is the last id
    for i in range(shape["vocab"] - 1 - len(vocab)):
        vocab[f"<extra_{i}>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    pad = vocab["<pad>"]
    torch.manual_seed(0)
    cfg = MarianConfig(vocab_size=len(vocab), d_model=shape["d_model"], encoder_layers=shape["layers"],
                       decoder_layers=shape["layers"], encoder_attention_heads=shape["heads"],
                       decoder_attention_heads=shape["heads"], encoder_ffn_dim=shape["ffn"],
                       decoder_ffn_dim=shape["ffn"], max_position_embeddings=shape["max_pos"], pad_token_id=pad,
                       decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
                       activation_function="swish", scale_embedding=True, dropout=0.0)
    MarianMTModel(cfg).save_pretrained(d, safe_serialization=True)
    (d / "generation_config.json").write_text(json.dumps({
        "bad_words_ids": [[pad]], "decoder_start_token_id": pad, "eos_token_id": 0, "forced_eos_token_id": 0,
        "max_length": shape["max_pos"], "num_beams": 4, "pad_token_id": pad}))
    return d


def make_nllb(shape: dict, d: Path) -> Path:
    """An NLLB-200 (M2M100) checkpoint of `shape` with random weights and the NLLB tokenizer of the committed
    test fixture hf-nllb (three language codes); the vocabulary is the shape's, so the output layer costs what
    the real one does."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    from tserve.testing.checkpoints import copy_tokenizer_and_config

    if (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists():
        return d
    copy_tokenizer_and_config(ROOT / "tests" / "fixtures" / "hf-nllb", d)  # the config is overwritten below
    torch.manual_seed(0)
    cfg = M2M100Config(vocab_size=shape["vocab"], d_model=shape["d_model"], encoder_layers=shape["layers"],
                       decoder_layers=shape["layers"], encoder_attention_heads=shape["heads"],
                       decoder_attention_heads=shape["heads"], encoder_ffn_dim=shape["ffn"],
                       decoder_ffn_dim=shape["ffn"], max_position_embeddings=shape["max_pos"], scale_embedding=True,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0)
    M2M100ForConditionalGeneration(cfg).eval().save_pretrained(d)
    return d


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(18, 30))).capitalize() + "." for _ in range(n)]


def batches(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


# --------------------------------------------------------------------------------------------------
# Hugging Face and CTranslate2, in this process
# --------------------------------------------------------------------------------------------------
def hf_rows(d: Path, texts: list[str], args: argparse.Namespace) -> list[Row]:
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    nllb = args.model == "nllb"
    tok = AutoTokenizer.from_pretrained(d, **({"src_lang": SOURCE} if nllb else {}))
    model = AutoModelForSeq2SeqLM.from_pretrained(d).eval()
    forced = {"forced_bos_token_id": tok.convert_tokens_to_ids(TARGET)} if nllb else {}
    rows = []
    for beams in args.beams:
        tokens, start = 0, time.perf_counter()
        with torch.inference_mode():
            for chunk in batches(texts, args.batch):
                enc = tok(chunk, return_tensors="pt", padding=True)
                out = model.generate(**enc, num_beams=beams, max_new_tokens=args.max_tokens, do_sample=False,
                                     **forced)
                tokens += int((out[:, 1:] != tok.pad_token_id).sum())  # the start token is not generated
        rows.append(Row("HF generate", beams, tokens, time.perf_counter() - start))
    return rows


def ct2_translators(d: Path, args: argparse.Namespace, work: Path) -> dict:
    """CTranslate2 translators of the checkpoint, float32 and int8 (its own converter), each warmed up."""
    import ctranslate2

    translators = {}
    for precision in ("float32", "int8"):
        out = work / f"ct2-{precision}"
        ctranslate2.converters.TransformersConverter(str(d)).convert(
            str(out), quantization=None if precision == "float32" else "int8", force=True)
        translators[precision] = ctranslate2.Translator(str(out), device="cpu", compute_type=precision,
                                                        inter_threads=1, intra_threads=args.threads)
    return translators


def ct2_pieces(d: Path, texts: list[str], args: argparse.Namespace) -> list[list[str]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d, **({"src_lang": SOURCE} if args.model == "nllb" else {}))
    return [tok.convert_ids_to_tokens(tok(t).input_ids) for t in texts]


def ct2_run(translator, pieces: list[list[str]], beams: int, args: argparse.Namespace,  # noqa: ANN001
            precision: str) -> Row:
    prefix = {"target_prefix": [[TARGET]] * len(pieces)} if args.model == "nllb" else {}
    start = time.perf_counter()
    results = translator.translate_batch(pieces, beam_size=beams, max_decoding_length=args.max_tokens,
                                         max_batch_size=args.batch, **prefix)
    tokens = sum(len(r.hypotheses[0]) for r in results)  # eos is not part of a hypothesis
    return Row(f"CTranslate2 {precision}", beams, tokens, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------------
# tserve over HTTP
# --------------------------------------------------------------------------------------------------
def languages(args: argparse.Namespace) -> dict[str, str]:
    return {"source_lang": SOURCE, "target_lang": TARGET} if args.model == "nllb" else {}


async def tserve_batches(url: str, texts: list[str], beams: int, args: argparse.Namespace, label: str) -> Row:
    tokens = 0
    async with httpx.AsyncClient(timeout=3600) as client:
        start = time.perf_counter()
        for chunk in batches(texts, args.batch):
            resp = await client.post(f"{url}/v1/translations", json={
                "input": chunk, "num_beams": beams, "max_tokens": args.max_tokens, **languages(args)})
            resp.raise_for_status()
            tokens += resp.json()["usage"]["completion_tokens"]
        return Row(f"tserve {label} HTTP, batches of {args.batch}", beams, tokens, time.perf_counter() - start)


async def tserve_clients(url: str, texts: list[str], beams: int, args: argparse.Namespace, label: str) -> Row:
    queue, tokens = list(texts), 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            resp = await client.post(f"{url}/v1/translations", json={
                "input": queue.pop(), "num_beams": beams, "max_tokens": args.max_tokens, **languages(args)})
            resp.raise_for_status()
            tokens += resp.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=args.clients + 4)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
        return Row(f"tserve {label} HTTP, {args.clients} clients", beams, tokens, time.perf_counter() - start)


@contextlib.contextmanager
def tserve_servers(d: Path, args: argparse.Namespace, work: Path) -> Iterator[dict[str, str]]:
    """A float32 and an int8 server of the checkpoint, both running; yields their URLs by precision."""
    from tserve.testing.server import ServerProcess

    rows_needed = max(args.batch, args.clients) * max(args.beams)
    # Both servers are up at once: on the real shapes each KV-cache pool is sized for this benchmark's rows (at
    # most 64 target and about 80 source positions each: 0.6 GB on opus-mt's shape, 2.5 GB on NLLB's), not by
    # the default (every row's whole length: 6.4 GB each on opus-mt's shape). NLLB's 1024 positions are capped.
    cap = ["--max-model-len", "128"] if args.model == "nllb" else []
    if not args.tiny:
        cap += ["--kv-cache-memory", "5GB" if args.model == "nllb" else "3GB"]
    with contextlib.ExitStack() as stack:
        urls = {}
        for precision in ("float32", "int8"):
            server = ServerProcess(["--model", f"mt={d}", "--max-running-requests", str(rows_needed), "--max-prompts",
                                    str(max(args.batch, 32)), "--quantize", "none" if precision == "float32" else "int8",
                                    # the warm-up and every mode send the same sentences: each must run the model
                                    "--translation-memory-max-entries", "0", *cap],
                                   work / f"server-{precision}.log",
                                   env={"OMP_NUM_THREADS": str(args.threads)}).wait_ready(timeout=600)
            stack.callback(server.stop)
            urls[precision] = server.url
        for url in urls.values():
            for beams in args.beams:
                asyncio.run(tserve_batches(url, sentences(args.batch, seed=1), beams, args, "warm-up"))
        yield urls


def measured_rounds(d: Path, texts: list[str], args: argparse.Namespace, work: Path) -> dict:
    """CTranslate2 and tserve in turns: each round runs every system at each beam count, the order of the
    systems reversed every other round, so that a machine whose speed drifts moves them alike. Returns each
    (system, beams)'s runs."""
    runs: dict[tuple[str, int], list[Row]] = {}
    with contextlib.ExitStack() as stack:
        systems = []
        if "ct2" not in args.skip:
            pieces = ct2_pieces(d, texts, args)
            for precision, translator in ct2_translators(d, args, work).items():
                translator.translate_batch(pieces[:2], beam_size=1, max_decoding_length=4)  # warm-up
                systems.append(lambda b, t=translator, p=precision: ct2_run(t, pieces, b, args, p))
        if "tserve" not in args.skip:
            urls = stack.enter_context(tserve_servers(d, args, work))
            for precision, url in urls.items():
                systems.append(lambda b, u=url, p=precision: asyncio.run(tserve_batches(u, texts, b, args, p)))
                systems.append(lambda b, u=url, p=precision: asyncio.run(tserve_clients(u, texts, b, args, p)))
        for r in range(args.rounds):
            for beams in args.beams:
                for system in (systems if r % 2 == 0 else systems[::-1]):
                    row = system(beams)
                    runs.setdefault((row.system, beams), []).append(row)
    return runs


def round_ratios(runs: dict, beams: int, precision: str) -> list[float]:
    """Each round's tserve (its better mode) / CTranslate2 at one precision."""
    ct2 = runs.get((f"CTranslate2 {precision}", beams), [])
    ours = [rows for (system, b), rows in runs.items() if b == beams and system.startswith(f"tserve {precision}")]
    return [max(mode[i].tokens_per_s for mode in ours) / ct2[i].tokens_per_s
            for i in range(len(ct2)) if ours]


# --------------------------------------------------------------------------------------------------
def print_table(rows: list[Row], beams: list[int]) -> None:
    systems = list(dict.fromkeys(r.system for r in rows))
    by = {(r.system, r.beams): r for r in rows}
    header = "| decoding | " + " | ".join(systems) + " | tserve / CTranslate2, float32 | tserve / CTranslate2, int8 |"
    print(header)
    print("|" + "---|" * (len(systems) + 3))
    for b in beams:
        cells = [f"{by[(s, b)].tokens_per_s:,.0f}" if (s, b) in by else "-" for s in systems]
        ratios = []
        for precision in ("float32", "int8"):  # tserve's better mode against CTranslate2 of the same precision
            ct2 = by.get((f"CTranslate2 {precision}", b))
            ours = max((r for r in rows if r.beams == b and r.system.startswith(f"tserve {precision}")),
                       key=lambda r: r.tokens_per_s, default=None)
            ratios.append(f"{ours.tokens_per_s / ct2.tokens_per_s:.2f}x" if ours and ct2 else "-")
        print(f"| {'greedy' if b == 1 else f'{b} beams'} | " + " | ".join(cells + ratios) + " |")


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and counts: every column in seconds")
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=2, help="threads of every system")
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf", "ct2", "tserve"])
    ap.add_argument("--model", choices=["opus-mt", "nllb"], default="opus-mt", help="the family and its shape")
    ap.add_argument("--rounds", type=int, default=3, help="turns of CTranslate2 and tserve (each row: the median)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.sentences, args.batch, args.clients, args.max_tokens, args.rounds = 8, 4, 4, 8, 2
    shape = SHAPES["tiny" if args.tiny else args.model]
    work = scratch_dir(None, "tserve-bench-mt-")
    if args.model == "nllb":  # 2.4 GB of random weights: kept under runs/ for the next run
        d = make_nllb(shape, work / "nllb" if args.tiny else ROOT / "runs" / "bench-nllb-600m")
    else:
        d = make_marian(shape, work / "marian")
    texts = sentences(args.sentences)
    rows: list[Row] = []
    if "hf" not in args.skip:
        rows += hf_rows(d, texts, args)
    runs = measured_rounds(d, texts, args, work)
    for got in runs.values():  # each system's median round
        rows.append(sorted(got, key=lambda row: row.tokens_per_s)[len(got) // 2])
    family = "NLLB-200 (English -> German)" if args.model == "nllb" else "Marian"
    from tserve.training.common import cpu_description

    print(f"\nCPU: {cpu_description()}")
    print(f"{family} {shape}, random weights; {args.sentences} sentences of 18-30 words, at most {args.max_tokens} "
          f"new tokens, {args.threads} threads per system; target tokens/s\n")
    print_table(rows, args.beams)
    print()
    for beams in args.beams:
        for precision in ("float32", "int8"):
            ratios = round_ratios(runs, beams, precision)
            if ratios:
                print(f"{'greedy' if beams == 1 else f'{beams} beams'}, tserve / CTranslate2 {precision}, each round: "
                      + ", ".join(f"{x:.2f}x" for x in ratios) + f"; median {statistics.median(ratios):.2f}x")
    return rows


if __name__ == "__main__":
    main()
