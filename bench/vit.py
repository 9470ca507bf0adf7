"""Image classification speed over HTTP against `transformers` in-process, in one run on the same weights.

    python bench/vit.py            # ViT-S/16 shape (384 wide, 12 layers, 6 heads, 224 px), random weights
    python bench/vit.py --tiny     # tiny shapes (the tests run this)

tserve: 1 client sending one PNG at a time, and --clients concurrent clients (dynamic batching), through
`/v1/classifications` (decode, preprocessing, batching, JSON). What a user would deploy instead: `transformers`'
`pipeline("image-classification")` behind a minimal FastAPI app on uvicorn (`bench/hf_pipeline_server.py`),
driven by the same clients with the same PNGs; both servers run at once and take turns (--rounds, each row
the median round), so that a drifting machine moves both alike. And `transformers`' `ViTForImageClassification`
in process on preprocessed tensors at batch 1 and batch --hf-batch (no decoding, no HTTP: a bound no service
reaches).
Reported: images per second.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
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
    "vit-s16": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                    image_size=224, patch_size=16),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                 patch_size=8),
}


@dataclass
class Row:
    system: str
    images: int
    seconds: float

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds


def make_vit(shape: dict, d: Path) -> Path:
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    size = shape["image_size"]  # the pipeline reads its preprocessing from here; tserve does too
    ViTImageProcessor(size={"height": size, "width": size}).save_pretrained(d)
    labels = {i: f"class {i}" for i in range(10)}
    ViTForImageClassification(ViTConfig(**shape, num_channels=3, id2label=labels,
                                        label2id={v: k for k, v in labels.items()})).save_pretrained(d)
    return d


def pngs(n: int, size: int) -> list[bytes]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def hf_rows(d: Path, shape: dict, args: argparse.Namespace) -> list[Row]:
    import torch
    from transformers import ViTForImageClassification

    torch.set_num_threads(args.threads)
    model = ViTForImageClassification.from_pretrained(d, attn_implementation="sdpa").eval()
    size, rows = shape["image_size"], []
    for batch in (1, args.hf_batch):
        x = torch.randn(batch, 3, size, size)
        with torch.inference_mode():
            model(pixel_values=x)
            n, start = 0, time.perf_counter()
            while n < args.images:
                model(pixel_values=x).logits.argmax(-1)
                n += batch
        rows.append(Row(f"HF, batch {batch}", n, time.perf_counter() - start))
    return rows


async def http_clients(url: str, images: list[bytes], clients: int) -> Row:
    queue = list(images)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            resp = await client.post(f"{url}/v1/classifications",
                                     json={"image": base64.b64encode(queue.pop()).decode()})
            resp.raise_for_status()

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        return Row(f"tserve HTTP, {clients} client{'s' if clients > 1 else ''}", len(images),
                   time.perf_counter() - start)


@contextlib.contextmanager
def pipeline_server(d: Path, args: argparse.Namespace, work: Path) -> Iterator[str]:
    """`transformers`' pipeline behind FastAPI + uvicorn, in its own process; yields its URL."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (work / "pipeline.log").open("w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "hf_pipeline_server.py"), "--model", str(d),
                             "--port", str(port), "--threads", str(args.threads)], stdout=log, stderr=log,
                            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.perf_counter() + 300
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"the pipeline server did not start: {(work / 'pipeline.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@contextlib.contextmanager
def tserve_server(d: Path, args: argparse.Namespace, work: Path) -> Iterator[str]:
    from tserve.testing.server import ServerProcess

    server = ServerProcess(["--model", f"vit={d}", "--batch-max-size", str(args.hf_batch)], work / "server.log",
                           env={"OMP_NUM_THREADS": str(args.threads)}).wait_ready(timeout=600)
    try:
        yield server.url
    finally:
        server.stop()


def service_rows(d: Path, images: list[bytes], args: argparse.Namespace, work: Path) -> tuple[list[Row], list[str]]:
    """The pipeline server and tserve, both running, driven in turns: each round runs 1 client and then
    --clients clients against each, the order of the two systems swapped every round, so that a machine
    whose speed drifts (a shared host) moves both alike. Each system's row is its median round; the lines
    returned give every round's ratios."""
    with pipeline_server(d, args, work) as pipeline_url, tserve_server(d, args, work) as tserve_url:
        urls = {"HF pipeline + FastAPI": pipeline_url, "tserve HTTP": tserve_url}
        for url in urls.values():
            asyncio.run(http_clients(url, images[:4], 1))  # warm-up
        runs: dict[tuple[str, int], list[Row]] = {}
        for r in range(args.rounds):
            for clients in (1, args.clients):
                for system in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                    row = asyncio.run(http_clients(urls[system], images, clients))
                    runs.setdefault((system, clients), []).append(row)
    rows, lines = [], []
    for (system, clients), got in runs.items():
        median = sorted(got, key=lambda row: row.images_per_s)[len(got) // 2]
        rows.append(Row(f"{system}, {clients} client{'s' if clients > 1 else ''}", median.images, median.seconds))
    rows.sort(key=lambda row: not row.system.startswith("HF"))  # the pipeline's rows first, as in the table
    for clients in (1, args.clients):
        pairs = zip(runs[("tserve HTTP", clients)], runs[("HF pipeline + FastAPI", clients)], strict=True)
        ratios = [t.images_per_s / p.images_per_s for t, p in pairs]
        lines.append(f"tserve / pipeline, {clients} client{'s' if clients > 1 else ''}, each round: "
                     + ", ".join(f"{x:.2f}x" for x in ratios) + f"; median {statistics.median(ratios):.2f}x")
    return rows, lines


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="turns of the two servers (each row: the median)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.images, args.clients, args.hf_batch, args.rounds = 8, 4, 4, 2
    shape = SHAPES["tiny" if args.tiny else "vit-s16"]
    work = scratch_dir(None, "tserve-bench-vit-")
    d = make_vit(shape, work / "vit")
    images = pngs(args.images, shape["image_size"])
    served, round_lines = service_rows(d, images, args, work)
    rows = hf_rows(d, shape, args) + served
    from tserve.training.common import cpu_description

    print(f"\nCPU: {cpu_description()}")
    print(f"ViT {shape}, random weights, {args.images} images, {args.threads} threads per system; images/s\n")
    print("| system | images/s |\n|---|---|")
    for r in rows:
        print(f"| {r.system} | {r.images_per_s:.1f} |")
    by = {r.system: r.images_per_s for r in rows}
    clients = f"{args.clients} clients"
    print(f"\ntserve / HF pipeline + FastAPI: 1 client "
          f"{by['tserve HTTP, 1 client'] / by['HF pipeline + FastAPI, 1 client']:.2f}x, {clients} "
          f"{by[f'tserve HTTP, {clients}'] / by[f'HF pipeline + FastAPI, {clients}']:.2f}x")
    print("\n".join(round_lines))
    print(f"tserve 1 client / HF batch 1: {by['tserve HTTP, 1 client'] / by['HF, batch 1']:.2f}x; "
          f"tserve {args.clients} clients / HF batch {args.hf_batch}: "
          f"{by[f'tserve HTTP, {args.clients} clients'] / by[f'HF, batch {args.hf_batch}']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
