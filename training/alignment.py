"""Choose a translator's alignment heads (model/alignment.py) on pairs whose alignment is known.

Known alignments come from words a translation keeps as they are: names, numbers, product and menu names
("LibreOffice", "Calc", "OK", "2.4"). A word that starts with a capital letter or holds a digit, and occurs
exactly once on each side of a reference pair, is aligned to itself; every target token of it must align into
the source word's tokens. Heads are chosen on the validation split and the accuracy is reported on the test
split, for the chosen heads and for the default (every head of the last decoder layer).

    python -m training align models/tserve-en-de            # writes alignment_heads into generation.json
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from pathlib import Path

from model.alignment import KnownAlignment, alignment_accuracy, choose_alignment_heads, token_spans
from model.checkpoint import LoadedModel, load
from model.html_markup import words

log = logging.getLogger("tserve.training.alignment")


def copy_alignments(loaded: LoadedModel, pairs: list[tuple[str, str]], limit: int) -> list[KnownAlignment]:
    """Up to `limit` pairs with at least one word kept as it is (see the module's notes), as known alignments."""
    tok, eos = loaded.tokenizer, loaded.config.eos_token_id
    out = []
    for en, de in pairs:
        src_words, tgt_words = words(en), words(de)
        src_count = Counter(en[s:e] for s, e in src_words)
        tgt_count = Counter(de[s:e] for s, e in tgt_words)
        kept = [w for w, c in src_count.items() if c == 1 and tgt_count.get(w) == 1
                and (w[0].isupper() or any(ch.isdigit() for ch in w))]
        if not kept:
            continue
        src_ids = tok.encode(en)
        tgt_ids = [t for t in tok.encode_target(de) if t != eos]
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


def choose(checkpoint: str | Path, limit: int = 400, write: bool = True, data_root: str | None = None) -> dict:
    """Choose on the validation split, report on the test split, and (with `write`) store the choice in the
    checkpoint's generation.json."""
    from training.data.translation import load_translation_pairs  # noqa: PLC0415 - fetches data

    loaded = load(checkpoint)
    splits = load_translation_pairs(data_root)
    valid = copy_alignments(loaded, [(p.en, p.de) for p in splits["valid"]], limit)
    test = copy_alignments(loaded, [(p.en, p.de) for p in splits["test"]], limit)
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
        path = Path(checkpoint) / "generation.json"
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
    a.set_defaults(func=lambda args: print(json.dumps(
        choose(args.checkpoint, args.limit, not args.no_write, args.data_dir), indent=2)) or 0)
