"""A long document in one `/v1/translations` request against its sentences sent one request at a time, on the
same server: time to the full translation.

    python bench/documents.py            # the bundled translator, a 20,000-character document
    python bench/documents.py --tiny     # 1,000 characters, 4 new tokens per sentence (the tests run this)

Modes: "one request" (the server splits the document and decodes its sentences side by side in the running
batch), "sentence by sentence" (a client sends each sentence and waits for it before the next: what a client
without document support does), and "sentences at once" (a client sends every sentence as its own request,
concurrently). Each mode translates the same sentences with the checkpoint's decoding (4 beams).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

SENTENCES = [
    "Click Save to keep your changes.", "The document is stored in the current folder.",
    "If the folder is read-only, choose another one.", "Choose Tools - Options - Load/Save - General.",
    "Select the default file format for new documents.", "The settings apply to new documents only.",
    "Press Enter to close the dialog.", "To print the current document, choose File - Print.",
    "Select the printer and the number of copies.", "Then click OK.",
    "You can also drag the file into the window.", "The toolbar shows the most common commands.",
    "Right-click a word to see the spelling suggestions.", "The status bar shows the page number.",
    "Use the Navigator to move between headings.", "Styles keep the formatting of your text consistent.",
]


@dataclass
class Row:
    mode: str
    requests: int
    seconds: float


def document(chars: int, seed: int = 0) -> str:
    """Paragraphs of 3-6 sentences, blank lines between them, up to `chars` characters."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    while sum(len(p) + 2 for p in paragraphs) < chars:
        paragraphs.append(" ".join(rng.choice(SENTENCES) for _ in range(rng.randint(3, 6))))
    text = "\n\n".join(paragraphs)
    return text[: text.rfind(".", 0, chars) + 1]


async def run_modes(url: str, text: str, sentences: list[str], max_tokens: int | None) -> list[Row]:
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(sentences) + 4)) as client:
        async def translate(item: str | list[str]) -> None:
            (await client.post(f"{url}/v1/translations", json={"input": item} | extra)).raise_for_status()

        await translate(sentences[:2])  # warm-up
        rows = []
        start = time.perf_counter()
        await translate(text)
        rows.append(Row("one request (the document)", 1, time.perf_counter() - start))
        start = time.perf_counter()
        for s in sentences:
            await translate(s)
        rows.append(Row("sentence by sentence", len(sentences), time.perf_counter() - start))
        start = time.perf_counter()
        await asyncio.gather(*(translate(s) for s in sentences))
        rows.append(Row("sentences at once", len(sentences), time.perf_counter() - start))
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default=str(ROOT / "models" / "tserve-en-de"))
    ap.add_argument("--chars", type=int, default=20_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per sentence (default: the model's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.chars, args.max_tokens = 1_000, 4
    from tserve.model.segmentation import split_sentences
    from tserve.testing.server import ServerProcess

    text = document(args.chars)
    sentences = split_sentences(text).segments
    work = scratch_dir(None, "tserve-bench-documents-")
    # Every mode sends the same sentences: without the translation memory each one runs the model.
    server = ServerProcess(["--model", f"mt={args.model}", "--max-queue", str(len(sentences) + 8),
                            "--translation-memory-max-entries", "0"],
                           work / "server.log", env={"OMP_NUM_THREADS": str(args.threads)}).wait_ready(timeout=600)
    try:
        rows = asyncio.run(run_modes(server.url, text, sentences, args.max_tokens))
    finally:
        server.stop()
    print(f"\n{len(text):,} characters, {len(sentences)} sentences, {Path(args.model).name}, "
          f"{args.threads} threads; seconds to the full translation\n")
    print("| mode | requests | seconds | vs one request |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r.mode} | {r.requests} | {r.seconds:.1f} | {r.seconds / rows[0].seconds:.2f}x |")
    return rows


if __name__ == "__main__":
    main()
