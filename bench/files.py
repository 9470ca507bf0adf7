"""A long Word file translated end to end through `POST /v1/translations/files`: seconds from upload to the
translated file, then the same file again with the translation memory warm.

    python bench/files.py             # the bundled translator, a 40-page .docx
    python bench/files.py --tiny      # 1 page, the tiny test translator, 4 new tokens per sentence (the tests run this)

For scale, the same sentences as one plain-text `/v1/translations` document (no formatting to place, no
memory) in the same run. The file is built here with python-docx: per page a heading and paragraphs of 2-4 sentences whose runs carry
real formatting (bold, italic, underline, colour) on some of their words, a table every fifth page, a header
and a footer, a page break between pages. Sentences are drawn from templates, so few repeat within the file.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the project's modules come from the repository root
from bench.scratch import scratch_dir  # noqa: E402 - after the path above

SUBJECTS = ["The document", "The current folder", "Your printer", "The toolbar", "The status bar", "The dialog",
            "The new file", "Each page", "The spelling check", "The Navigator", "The default style", "This setting"]
VERBS = ["shows", "keeps", "opens", "saves", "prints", "closes", "changes", "selects", "moves", "checks"]
OBJECTS = ["the page number", "your changes", "the most common commands", "the selected text", "a new window",
           "the first heading", "every table", "the file format", "the number of copies", "the last version"]
ENDINGS = ["", " when you press Enter", " after you click OK", " in the current document", " for new documents only"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}."


def build_docx(pages: int, seed: int = 0) -> tuple[bytes, int]:
    """The file and its number of sentences."""
    import docx
    from docx.enum.text import WD_BREAK
    from docx.shared import RGBColor

    rng = random.Random(seed)
    d = docx.Document()
    d.core_properties.title = "Working with documents"
    d.sections[0].header.paragraphs[0].text = "Working with documents: a short guide."
    d.sections[0].footer.paragraphs[0].text = "Keep this guide for later."
    count = 2
    for page in range(pages):
        d.add_heading(sentence(rng).rstrip("."), level=1)
        count += 1
        for _ in range(10):
            para = d.add_paragraph()
            for k in range(rng.randint(2, 4)):
                words = sentence(rng).split()
                a = rng.randrange(len(words))
                b = min(len(words), a + rng.randint(1, 3))
                para.add_run((" " if k else "") + " ".join(words[:a]) + (" " if a else ""))
                marked = para.add_run(" ".join(words[a:b]))
                style = rng.choice(["bold", "italic", "underline", "colour"])
                if style == "colour":
                    marked.font.color.rgb = RGBColor(0xC0, 0x20, 0x20)
                else:
                    setattr(marked, style, True)
                para.add_run((" " if b < len(words) else "") + " ".join(words[b:]))
                count += 1
        if page % 5 == 4:
            table = d.add_table(rows=2, cols=2)
            for cell in (c for row in table.rows for c in row.cells):
                cell.text = sentence(rng)
                count += 1
        d.add_paragraph().add_run().add_break(WD_BREAK.PAGE)
    out = io.BytesIO()
    d.save(out)
    return out.getvalue(), count


def translate(url: str, data: bytes, fields: dict) -> float:
    """Upload, follow the job's events to its end (as the page does), download."""
    start = time.perf_counter()
    resp = httpx.post(f"{url}/v1/translations/files", files={"file": ("guide.docx", data)}, data=fields, timeout=600)
    resp.raise_for_status()
    job = resp.json()
    with httpx.stream("GET", f"{url}/v1/translations/jobs/{job['id']}/events", timeout=600) as events:
        for line in events.iter_lines():
            if line.startswith("data: "):
                job = json.loads(line[6:])
    if job["status"] != "succeeded":
        raise RuntimeError(job)
    httpx.get(url + job["download_url"], timeout=60).raise_for_status()
    return time.perf_counter() - start


def translate_text(url: str, data: bytes, max_tokens: int | None) -> float:
    """The file's paragraphs as plain text, one document request: the same sentences without the file's
    reading, alignment and writing."""
    import docx

    d = docx.Document(io.BytesIO(data))
    texts = [p.text for p in d.paragraphs if p.text.strip()]
    texts += [c.text for t in d.tables for row in t.rows for c in row.cells]
    texts += [d.sections[0].header.paragraphs[0].text, d.sections[0].footer.paragraphs[0].text]
    body = {"input": "\n\n".join(texts), "cache": False} | ({} if max_tokens is None else {"max_tokens": max_tokens})
    start = time.perf_counter()
    httpx.post(f"{url}/v1/translations", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[tuple[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default=str(ROOT / "models" / "tserve-en-de"))
    ap.add_argument("--pages", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per sentence (default: the model's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.pages, args.max_tokens, args.model = 1, 4, str(ROOT / "tests" / "fixtures" / "tiny-mt")
    from tserve.testing.server import ServerProcess
    from tserve.training.common import cpu_name

    data, sentences = build_docx(args.pages)
    work = scratch_dir(None, "tserve-bench-files-")
    server = ServerProcess(["--model", f"mt={args.model}", "--translation-memory", str(work / "memory.sqlite"),
                            "--file-dir", str(work / "files")], work / "server.log",
                           env={"OMP_NUM_THREADS": str(args.threads)}).wait_ready(timeout=600)
    fields = {} if args.max_tokens is None else {"max_tokens": str(args.max_tokens)}
    try:
        translate(server.url, build_docx(1, seed=1)[0], fields)  # warm-up, other sentences
        rows = [("its text as one `/v1/translations` document (no formatting, no memory)",
                 translate_text(server.url, data, args.max_tokens)),
                ("first upload", translate(server.url, data, fields)),
                ("second upload (translation memory warm)", translate(server.url, data, fields))]
    finally:
        server.stop()
    print(f"\n{args.pages}-page .docx ({len(data):,} bytes, about {sentences} sentences), {Path(args.model).name}, "
          f"{args.threads} threads, CPU: {cpu_name()}; seconds from upload to the "
          "translated file\n")
    print("| run | seconds | sentences/s |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} | {sentences / seconds:.1f} |")
    return rows


if __name__ == "__main__":
    main()
