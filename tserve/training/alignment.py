"""Choose a translator's alignment heads (tserve/model/alignment.py) on pairs whose alignment is known.

Known alignments come from words a translation keeps as they are: names, numbers, product and menu names
("LibreOffice", "Calc", "OK", "2.4"). A word that starts with a capital letter or holds a digit, and occurs
exactly once on each side of a reference pair, is aligned to itself; every target token of it must align into
the source word's tokens. Heads are chosen on the validation split and the accuracy is reported on the test
split, for the chosen heads and for the default (every head of the last decoder layer).

    python -m tserve.training align models/tserve-en-de            # writes alignment_heads into generation.json
    python -m tserve.training align /data/nllb-200-distilled-600M  # an imported translator: generation_config.json

A one-pair translator reads the pairs in its own direction (German → English for tserve-de-en); a multilingual
one in --source-lang → --target-lang (default English → German), its languages' codes where the model wants them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from pathlib import Path

from tserve.model.alignment import KnownAlignment, alignment_accuracy, choose_alignment_heads, token_spans
from tserve.model.checkpoint import LoadedModel, load
from tserve.model.html_markup import words
from tserve.model.language_codes import model_code

log = logging.getLogger("tserve.training.alignment")


def copy_alignments(loaded: LoadedModel, pairs: list[tuple[str, str]], limit: int,
                    languages: tuple[str | None, str] | None = None) -> list[KnownAlignment]:
    """Up to `limit` pairs with at least one word kept as it is (see the module's notes), as known alignments;
    `languages`: a multilingual model's (source, target) codes."""
    tok, eos = loaded.tokenizer, loaded.config.eos_token_id
    prefix = tok.target_prefix(languages)
    out = []
    for en, de in pairs:
        src_words, tgt_words = words(en), words(de)
        src_count = Counter(en[s:e] for s, e in src_words)
        tgt_count = Counter(de[s:e] for s, e in tgt_words)
        kept = [w for w, c in src_count.items() if c == 1 and tgt_count.get(w) == 1
                and (w[0].isupper() or any(ch.isdigit() for ch in w))]
        if not kept:
            continue
        src_ids = tok.source_in(en, languages)
        tgt_ids = [*prefix, *tok.encode(de, add_special_tokens=False)] if prefix else \
            [t for t in tok.encode_target(de) if t != eos]
        if len(src_ids) > loaded.config.max_source_len or len(tgt_ids) + 1 > loaded.config.max_target_len:
            continue
        src_spans, tgt_spans = token_spans(tok, src_ids, en), token_spans(tok, tgt_ids, de)
        gold: dict[int, set[int]] = {}
        for w in kept:
            (s0, e0), = [(s, e) for s, e in src_words if en[s:e] == w]
            (s1, e1), = [(s, e) for s, e in tgt_words if de[s:e] == w]
            sources = {j for j, (a, b) in enumerate(src_spans) if a < b and a < e0 and b > s0}
            for t, (a, b) in enumerate(tgt_spans):
                if a < b and a < e1 and b > s1 and sources:
                    gold[t] = sources
        if gold:
            out.append(KnownAlignment(src_ids, tgt_ids, gold))
        if len(out) == limit:
            break
    return out


def reading(loaded: LoadedModel, source: str, target: str) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """The sides of the English-German pairs a translator reads (its own pair, else `source`, `target`), and a
    multilingual model's codes for them."""
    codes = loaded.tokenizer.language_codes
    sides = loaded.languages or (source, target)
    if not codes:
        return sides, None
    mapped = tuple(model_code(side, codes) for side in sides)
    if None in mapped:
        raise ValueError(f"the model has no code for {sides}; its languages: {', '.join(codes)}")
    return sides, mapped


def choose(checkpoint: str | Path, limit: int = 400, write: bool = True, data_root: str | None = None,
           source: str = "en", target: str = "de", splits: dict | None = None) -> dict:
    """Choose on the validation split, report on the test split, and (with `write`) store the choice in the
    checkpoint's generation.json (ours) or generation_config.json (a Hugging Face checkpoint's). `splits`:
    other English-German pairs than the packaged data's (`training.data.pairs.TranslationPair`)."""
    loaded = load(checkpoint)
    if splits is None:
        from tserve.training.data.translation import load_translation_pairs  # noqa: PLC0415 - fetches data

        splits = load_translation_pairs(data_root)
    (src, tgt), languages = reading(loaded, source, target)
    valid = copy_alignments(loaded, [(p.side(src), p.side(tgt)) for p in splits["valid"]], limit, languages)
    test = copy_alignments(loaded, [(p.side(src), p.side(tgt)) for p in splits["test"]], limit, languages)
    if not valid:
        raise ValueError("no pair with a word kept as it is on both sides: nothing to choose heads on")
    choice = choose_alignment_heads(loaded, valid)
    cfg = loaded.config
    default = [(cfg.n_decoder_layers - 1, h) for h in range(cfg.n_heads)]
    report = {
        "heads": [list(h) for h in choice.heads], "offset": choice.offset,
        "valid_pairs": len(valid), "test_pairs": len(test),
        "valid_accuracy": round(choice.accuracy, 4),
        "test_accuracy": round(alignment_accuracy(loaded, test, choice.heads, choice.offset), 4),
        "test_accuracy_last_layer_all_heads": round(alignment_accuracy(loaded, test, default, 0), 4),
        "test_gold_tokens": sum(len(e.gold) for e in test),
    }
    if write:
        ours = "architecture" in json.loads((Path(checkpoint) / "config.json").read_text())
        path = Path(checkpoint) / ("generation.json" if ours else "generation_config.json")
        gen = json.loads(path.read_text()) if path.is_file() else {}
        gen |= {"alignment_heads": report["heads"], "alignment_offset": choice.offset}
        path.write_text(json.dumps(gen, indent=2) + "\n")
    return report


def register(subparsers: argparse._SubParsersAction) -> None:
    a = subparsers.add_parser("align", help="choose a translator's alignment heads (for HTML tag placement)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("checkpoint", help="translator checkpoint directory")
    a.add_argument("--limit", type=int, default=400, help="known-alignment pairs per split")
    a.add_argument("--data-dir", default=None, help="data cache (default data/ or $TSERVE_DATA_DIR)")
    a.add_argument("--no-write", action="store_true", help="print the choice without writing it")
    a.add_argument("--source-lang", default="en", choices=("en", "de"),
                   help="a multilingual translator: the side of the English-German pairs it reads")
    a.add_argument("--target-lang", default="de", choices=("en", "de"), help="... and the side it writes")
    a.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`tserve align`: the choice as JSON, or one line saying why there is none (exit 1), as `train` and `eval`."""
    try:
        report = choose(args.checkpoint, args.limit, not args.no_write, args.data_dir, args.source_lang,
                        args.target_lang)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0
