"""Held-out evaluation of trained checkpoints; writes `metrics.json` and refreshes `MODEL_CARD.md`.

- translation: SacreBLEU BLEU and chrF of beam search (the checkpoint's generation.json, 4 beams) on
  the test split, overall and per source, plus the Ding example sentences alone and a few fixed probes;
- lm: test-split perplexity (sliding windows, every token predicted once with at least half a context
  of history), next to unigram and bigram (add-k) baselines estimated on the training split with the
  same tokenizer, so the numbers are comparable; plus a few sampled continuations;
- vit: test accuracy through the full serving preprocessing, and again on colour-inverted test images
  (what a dark-on-light photo looks like), and on "photo-like" versions (enlarged, dark on light grey
  paper, off centre, colour JPEG), which the preprocessing must bring back to the training format.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tserve.model.checkpoint import LoadedModel, load
from tserve.model.decoding import SamplingParams, generate, translation_job
from tserve.model.decoding.seq2seq_runner import run_jobs
from tserve.model.quantize import resolve_activations
from tserve.training import data as data_mod
from tserve.training.card import METRICS_FILE, TRAINING_FILE, read_json, write_card, write_json
from tserve.training.common import configure_threads, log_event, resolve_device

PROBES = {"en": ["Good morning.", "Where is the station?", "I don't know.", "Thank you very much.",
                 "The weather is nice today.", "Open the file.", "Save the document."],
          "de": ["Guten Morgen.", "Wo ist der Bahnhof?", "Ich weiß es nicht.", "Vielen Dank.",
                 "Das Wetter ist heute schön.", "Öffnen Sie die Datei.", "Speichern Sie das Dokument."]}
# metrics.json's key for the int8 figures of each kind of activations: 8-bit ones (what a CPU with VNNI or AMX
# runs) keep the key they always had.
QUANTIZED_FIGURES = {"full": "int8", "split": "int8_split", "7bit": "int8_7bit", "7bit-weights": "int8_7bit_weights",
                     "int4": "int4", "q8_0": "q8_0", "q4_0": "q4_0"}
LM_PROMPTS = ["The king said", "It is a truth universally acknowledged", "Love is"]


# --------------------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------------------
def translate(loaded: LoadedModel, sources: Sequence[str], num_beams: int | None = None,
              max_new_tokens: int | None = None) -> list[str]:
    """Beam-search translations with the checkpoint's decoding defaults. The output length is also
    capped at 2 x source tokens + 10 (German runs longer than English, but not that much), which only
    bounds the time spent on degenerate hypotheses."""
    tok, cfg = loaded.tokenizer, loaded.config
    assert tok is not None
    jobs = []
    for text in sources:
        ids = tok.encode(text)[: cfg.max_source_len]
        job = translation_job(loaded, ids, num_beams, max_new_tokens)
        job.max_new_tokens = min(job.max_new_tokens, 2 * len(ids) + 10)
        jobs.append(job)
    return [tok.decode(s.output_ids).strip() for s in run_jobs(loaded, jobs)]


def bleu_chrf(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    import sacrebleu  # noqa: PLC0415

    if not hypotheses:
        return {"bleu": None, "chrf": None, "n": 0}
    return {"bleu": round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2), "n": len(hypotheses)}


def languages_of(loaded: LoadedModel) -> tuple[str, str]:
    """The (source, target) sides of the English-German pairs a bundled translator reads."""
    return loaded.languages or ("en", "de")


def evaluate_translation(loaded: LoadedModel, pairs: Sequence[data_mod.TranslationPair],
                         num_beams: int | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    source, target = languages_of(loaded)
    hyps = translate(loaded, [p.side(source) for p in pairs], num_beams)
    refs = [p.side(target) for p in pairs]
    metrics: dict[str, Any] = {"num_beams": num_beams or loaded.generation.num_beams, **bleu_chrf(hyps, refs)}
    by_source: dict[str, Any] = {}
    for src in data_mod.TRANSLATION_SOURCES:
        idx = [i for i, p in enumerate(pairs) if p.source == src]
        if idx:
            by_source[src] = bleu_chrf([hyps[i] for i in idx], [refs[i] for i in idx])
    metrics["by_source"] = by_source
    idx = [i for i, p in enumerate(pairs) if p.source == "ding" and data_mod.looks_like_sentence(p.en)]
    metrics["ding_sentences"] = bleu_chrf([hyps[i] for i in idx], [refs[i] for i in idx])
    probes = translate(loaded, PROBES[source], num_beams)
    metrics["samples"] = [[text, out] for text, out in zip(PROBES[source], probes, strict=True)] + \
        [[pairs[i].side(source), hyps[i], f"(reference: {refs[i]})"] for i in idx[:5]]
    metrics["seconds"] = round(time.perf_counter() - start, 1)
    return metrics


# --------------------------------------------------------------------------------------------------
# Language model
# --------------------------------------------------------------------------------------------------
def ngram_baselines(train_ids: np.ndarray, test_ids: np.ndarray, vocab_size: int,
                    valid_ids: np.ndarray | None = None, ks: Sequence[float] = (1.0, 0.1, 0.01, 0.001)
                    ) -> dict[str, float]:
    """Perplexities of an add-1 unigram and an add-k bigram model (k chosen on `valid_ids`, or on the
    test ids when no validation text is given) estimated on `train_ids`, on the test targets test_ids[1:]
    (the same positions a causal LM predicts)."""
    V = vocab_size
    uni = np.bincount(train_ids, minlength=V).astype(np.float64)
    uni_p = (uni + 1.0) / (uni.sum() + V)
    targets = test_ids[1:]
    unigram_ppl = float(np.exp(-np.log(uni_p[targets]).mean()))
    pair_keys = train_ids[:-1].astype(np.int64) * V + train_ids[1:]
    keys, counts = np.unique(pair_keys, return_counts=True)
    context_counts = np.bincount(train_ids[:-1], minlength=V).astype(np.float64)

    def bigram_nll(ids: np.ndarray, k: float) -> float:
        q = ids[:-1].astype(np.int64) * V + ids[1:]
        pos = np.searchsorted(keys, q)
        pos_c = np.minimum(pos, len(keys) - 1)
        c = np.where(keys[pos_c] == q, counts[pos_c], 0).astype(np.float64)
        p = (c + k) / (context_counts[ids[:-1]] + k * V)
        return float(-np.log(p).mean())

    tune = valid_ids if valid_ids is not None and len(valid_ids) > 1 else test_ids
    best_k = min(ks, key=lambda k: bigram_nll(tune, k))
    return {"unigram_ppl": round(unigram_ppl, 2), "bigram_ppl": round(float(np.exp(bigram_nll(test_ids, best_k))), 2),
            "bigram_k": best_k}


def evaluate_lm(loaded: LoadedModel, test_texts: Sequence[str], train_texts: Sequence[str],
                valid_texts: Sequence[str] = (), samples: bool = True) -> dict[str, Any]:
    from tserve.training.lm import strided_nll, token_stream  # noqa: PLC0415

    start = time.perf_counter()
    tok, model = loaded.tokenizer, loaded.model
    test_stream = token_stream(tok, list(test_texts))
    context = model.cfg.max_seq_len
    nll, count = strided_nll(model, test_stream, context, context // 2)
    metrics: dict[str, Any] = {"perplexity": round(math.exp(nll), 2), "loss": round(nll, 4), "test_tokens": count,
                               "context": context, "stride": context // 2}
    if train_texts:
        train_stream = token_stream(tok, list(train_texts))
        valid_stream = token_stream(tok, list(valid_texts)) if valid_texts else None
        metrics.update(ngram_baselines(train_stream, test_stream, tok.vocab_size, valid_stream))
    if samples:
        prompts = [tok.encode(p) for p in LM_PROMPTS]
        params = [SamplingParams(max_tokens=max(1, min(48, context - len(ids))), temperature=0.8, top_k=40, seed=i)
                  for i, ids in enumerate(prompts)]
        done = generate(loaded, prompts, params)
        metrics["samples"] = [[p, p + tok.decode(s.generated)] for p, s in zip(LM_PROMPTS, done, strict=True)]
    metrics["seconds"] = round(time.perf_counter() - start, 1)
    return metrics


# --------------------------------------------------------------------------------------------------
# Image classifier
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_vit(loaded: LoadedModel, x: np.ndarray, y: np.ndarray, batch_size: int = 500,
                 inverted: bool = True) -> dict[str, Any]:
    """Accuracy with the checkpoint's full preprocessing (PIL image in), as the service would see it."""
    pre, model = loaded.preprocessing, loaded.model
    assert pre is not None
    start = time.perf_counter()
    device = next(model.parameters()).device

    def acc(images: np.ndarray) -> tuple[float, np.ndarray]:
        preds = []
        for i in range(0, len(images), batch_size):
            batch = torch.stack([pre.normalize(pre.to_array(img)) for img in images[i : i + batch_size]])
            preds.append(model(batch.to(device, loaded.dtype)).argmax(-1).cpu())
        p = torch.cat(preds).numpy() if preds else np.zeros(0, dtype=np.int64)
        return float((p == y).mean()) if len(y) else float("nan"), p

    accuracy, preds = acc(x)
    labels = loaded.labels or []
    per_class = {labels[c] if c < len(labels) else str(c): round(float((preds[y == c] == c).mean()), 4)
                 for c in np.unique(y)}
    out: dict[str, Any] = {"accuracy": round(accuracy, 4), "n": int(len(y))}
    if inverted:
        out["accuracy_inverted_images"] = round(acc(255 - x)[0], 4)
        m = min(len(y), 500)
        rng = np.random.default_rng(0)
        photos = [photo_like(img, rng) for img in x[:m]]
        p_preds = torch.cat([model(torch.stack([pre(ph) for ph in photos[i : i + 100]]).to(device, loaded.dtype))
                             .argmax(-1).cpu() for i in range(0, m, 100)]).numpy() if m else np.zeros(0)
        out["accuracy_photo_like"] = round(float((p_preds == y[:m]).mean()), 4) if m else None
        out["photo_like_n"] = m
    return {**out, "per_class_accuracy": per_class, "seconds": round(time.perf_counter() - start, 1)}


def photo_like(image: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A test image the way a user might send it: enlarged, dark on a light grey noisy background, off
    centre on a larger colour canvas, JPEG-compressed."""
    size = int(rng.integers(120, 260))
    obj = Image.fromarray(255 - image).resize((size, size), Image.Resampling.BICUBIC)
    w, h = size + int(rng.integers(40, 200)), size + int(rng.integers(40, 200))
    paper = float(rng.uniform(190, 245))
    canvas = np.full((h, w), paper, dtype=np.float32)
    x0, y0 = int(rng.integers(0, w - size + 1)), int(rng.integers(0, h - size + 1))
    ink = np.asarray(obj, dtype=np.float32) / 255.0  # 1 = background, 0 = object
    canvas[y0 : y0 + size, x0 : x0 + size] *= ink
    canvas += rng.normal(0, 6, canvas.shape)
    rgb = np.clip(np.stack([canvas * t for t in (1.0, 0.97, 0.92)], axis=-1), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="JPEG", quality=80)
    buf.seek(0)
    return Image.open(buf)


# --------------------------------------------------------------------------------------------------
def _vit_dataset(path: Path, loaded: LoadedModel) -> str:
    info = read_json(path / TRAINING_FILE)
    if info.get("dataset"):
        return str(info["dataset"])
    return "mnist-digits" if loaded.labels == [str(i) for i in range(10)] else "fashion-mnist"


#: Size of the test slice whose metrics are recorded next to the full ones, so that a quick check
#: (tests/model/test_bundled_models.py) can reproduce them exactly without a full evaluation.
REFERENCE_SLICE = {"translation": 40, "lm": 10, "vit": 300}
SLICE_KEYS = {"translation": ("bleu", "chrf"), "lm": ("perplexity",), "vit": ("accuracy",)}


def task_of(loaded: LoadedModel) -> str:
    return {"translation": "translation", "text-generation": "lm", "image-classification": "vit"}[loaded.task]


def evaluate_loaded(loaded: LoadedModel, path: Path, *, limit: int | None = None, data_root: str | None = None,
                    full: bool = True) -> dict[str, Any]:
    """Metrics of a loaded checkpoint on (the first `limit` items of) its test split. `full=False` leaves
    out what only the complete report needs (n-gram baselines, samples, inverted images, per source)."""
    task = task_of(loaded)
    if task == "translation":
        pairs = data_mod.load_translation_pairs(data_root)["test"]
        pairs = pairs[:limit] if limit else pairs
        if not full:
            source, target = languages_of(loaded)
            return bleu_chrf(translate(loaded, [p.side(source) for p in pairs]), [p.side(target) for p in pairs])
        return evaluate_translation(loaded, pairs)
    if task == "lm":
        corpus = data_mod.load_lm_corpus(data_root)
        test = corpus["test"][:limit] if limit else corpus["test"]
        if not full:
            return evaluate_lm(loaded, test, [], samples=False)
        return evaluate_lm(loaded, test, corpus["train"], corpus["valid"])
    dataset = _vit_dataset(path, loaded)
    from tserve.training.vit import load_dataset  # noqa: PLC0415

    x, y = load_dataset(dataset, data_root)["test"]
    if limit:
        x, y = x[:limit], y[:limit]
    return {"dataset": dataset, **evaluate_vit(loaded, x, y, inverted=full)}


def _lm_agreement(path: Path, quantized: LoadedModel, limit: int | None, data_root: str | None) -> float:
    """Teacher-forced top-1 agreement of a quantized LM with the float32 model of the same checkpoint on (the first
    `limit` texts of) its test split, over the positions its perplexity scores."""
    from tserve.training.lm import strided_top1_agreement, token_stream  # noqa: PLC0415

    reference = load(path, device=quantized.device, dtype="float32")
    test = data_mod.load_lm_corpus(data_root)["test"]
    stream = token_stream(quantized.tokenizer, list(test[:limit] if limit else test))
    context = quantized.model.cfg.max_seq_len
    return strided_top1_agreement(reference.model, quantized.model, stream, context, context // 2)[0]


def evaluate_checkpoint(path: str | Path, *, limit: int | None = None, device: str = "auto",
                        data_root: str | None = None, write: bool = True, quantize: str = "none",
                        int8_activations: str = "auto") -> dict[str, Any]:
    """Evaluate a checkpoint on the test split of its data set (the first `limit` items when given).
    A full evaluation also records the metrics of the first REFERENCE_SLICE items. With `write`, store
    `metrics.json` next to the weights and re-render the model card. `quantize="int8"`: the figures of the
    int8 model (`--quantize int8`, activations as `int8_activations` says), stored beside the float32 ones
    under the key `QUANTIZED_FIGURES` gives those activations; `quantize="int4"`: the int4 model's (group size
    32, the default), under `int4`; `"q8_0"` / `"q4_0"`: llama.cpp's block formats', under their names. A language
    model's quantized figures include its teacher-forced top-1 agreement with the float32 model."""
    configure_threads()
    path = Path(path)
    loaded = load(path, device=resolve_device(device), dtype="float32", quantize=quantize,
                  int8_activations=int8_activations)
    if quantize != "none":
        metrics = evaluate_loaded(loaded, path, limit=limit, data_root=data_root)
        scheme = quantize if quantize in ("int4", "q8_0", "q4_0") else resolve_activations(int8_activations)
        detail = {"group_size": 32} if quantize in ("int4", "q8_0", "q4_0") else {"activations": scheme}
        figures = {"limit": limit, **detail, **{k: v for k, v in metrics.items() if k != "samples"}}
        if task_of(loaded) == "lm":  # the quantized model's next tokens against the float32 model's
            figures["top1_agreement"] = round(_lm_agreement(path, loaded, limit, data_root), 4)
        if write:
            stored = read_json(path / METRICS_FILE) if (path / METRICS_FILE).is_file() else {}
            write_json(path / METRICS_FILE, stored | {QUANTIZED_FIGURES[scheme]: figures})
            write_card(path)
        return figures
    kept = {}  # a float32 evaluation keeps the quantized figures it does not recompute
    if (path / METRICS_FILE).is_file():
        kept = {k: v for k, v in read_json(path / METRICS_FILE).items() if k in QUANTIZED_FIGURES.values()}
    start = time.perf_counter()
    task = task_of(loaded)
    metrics = evaluate_loaded(loaded, path, limit=limit, data_root=data_root)
    metrics = {"task": task, "split": "test", "limit": limit, **metrics}
    if limit is None:
        n = REFERENCE_SLICE[task]
        ref = evaluate_loaded(loaded, path, limit=n, data_root=data_root, full=False)
        metrics["reference_slice"] = {"limit": n, **{k: ref[k] for k in SLICE_KEYS[task]}}
    log_event("evaluation", path=str(path), total_seconds=round(time.perf_counter() - start, 1),
              **{k: v for k, v in metrics.items() if not isinstance(v, (list, dict))})
    if write:
        write_json(path / METRICS_FILE, metrics | kept)
        write_card(path)
    return metrics
