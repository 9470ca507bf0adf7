"""Training data and loops in the configurations their other tests leave out: the translation data set built from
several sources (deduplication, a length limit, the split by the English side, caches per split fractions), LM
chunks of a non-default size, a constant learning-rate schedule with warm-up, LM runs planned in epochs, a ViT's
held-out validation images, a translator's tokenizer, validation split and length filter, and the alignment
report's test split. All on CPU in seconds with inline data; the package fetchers are replaced (no downloads)."""

from __future__ import annotations

import json

import pytest

from tests.training.test_train import LM_TEXTS, PAIRS, _images, _loop
from tserve.model.checkpoint import load
from tserve.training import bpe, lm, translation, vit
from tserve.training.common import RunOptions
from tserve.training.data import TranslationPair, load_translation_pairs, merge_translation_sources
from tserve.training.data import lm as lm_data
from tserve.training.data import translation as translation_data
from tserve.training.loop import LoopConfig, learning_rate


# --------------------------------------------------------------------------------------------------
# The translation data set: merging, deduplication, the split, its cache
# --------------------------------------------------------------------------------------------------
def test_merging_keeps_every_german_translation_of_one_english_text_once():
    """Exact duplicates go (the first source keeps them); another German translation of the same English is a
    different pair and stays."""
    merged = merge_translation_sources({
        "ding": [("Open the file.", "Öffne die Datei."), ("Open the file.", "Datei öffnen.")],
        "lo-help": [("open the file", "Datei öffnen"), ("Save.", "Speichern.")],
    })
    assert [(p.en, p.de, p.source) for p in merged] == [
        ("Open the file.", "Öffne die Datei.", "ding"), ("Open the file.", "Datei öffnen.", "ding"),
        ("Save.", "Speichern.", "lo-help")]


def test_merging_applies_a_smaller_length_limit_than_the_default():
    long_en, long_de = "This sentence is longer than thirty characters.", "Dieser Satz ist länger als dreißig Zeichen."
    pairs = [("Short one.", "Kurz."), (long_en, long_de)]
    assert len(merge_translation_sources({"ding": pairs})) == 2
    assert [p.en for p in merge_translation_sources({"ding": pairs}, max_chars=30)] == ["Short one."]


@pytest.fixture
def offline_sources(tmp_path, monkeypatch):
    """`load_translation_pairs` with the Debian packages replaced: Ding gives 150 English sentences with two German
    translations each, the help and UI catalogues one pair each."""
    ding = [(f"Sentence number {i} is here.", f"{variant} Nummer {i} ist hier.")
            for i in range(150) for variant in ("Satz", "Der Satz")]
    calls = []

    def fetch_deb(package, root=None):  # noqa: ANN001, ANN202
        calls.append(package)
        d = tmp_path / "debs" / package
        d.mkdir(parents=True, exist_ok=True)
        (d / "ui.mo").touch()
        return d

    monkeypatch.setattr(translation_data, "fetch_deb", fetch_deb)
    monkeypatch.setattr(translation_data, "parse_ding", lambda path: ding)
    monkeypatch.setattr(translation_data, "parse_libreoffice_help", lambda en, de: [("Help page.", "Hilfeseite.")])
    monkeypatch.setattr(translation_data, "parse_mo", lambda path: [("Save As", "Speichern unter")])
    return tmp_path / "data", calls


def test_every_translation_of_an_english_text_lands_in_its_split(offline_sources):
    """Splits go by the English side: a test sentence's other translation may not be trained on."""
    root, _ = offline_sources
    splits = load_translation_pairs(root, valid_frac=0.3, test_frac=0.3)
    where: dict[str, set[str]] = {}
    for name, pairs in splits.items():
        for p in pairs:
            where.setdefault(p.en, set()).add(name)
    assert len(where) == 152 and all(len(s) == 1 for s in where.values())
    assert all(len(splits[s]) > 40 for s in ("train", "valid", "test"))
    assert {p.source for s in splits.values() for p in s} == {"ding", "lo-help", "lo-ui"}


def test_a_cached_translation_split_is_not_reused_for_other_fractions(offline_sources):
    """The processed cache is named after both fractions: asking for no test split after a 30 % one builds a new
    split (with an empty test set), while asking again for the same fractions reads the cache."""
    root, calls = offline_sources
    first = load_translation_pairs(root, valid_frac=0.3, test_frac=0.3)
    built = len(calls)
    again = load_translation_pairs(root, valid_frac=0.3, test_frac=0.3)
    assert len(calls) == built and again == first
    no_test = load_translation_pairs(root, valid_frac=0.3, test_frac=0.0)
    assert no_test["test"] == [] and len(no_test["valid"]) == len(first["valid"])
    assert len(no_test["train"]) == len(first["train"]) + len(first["test"])


# --------------------------------------------------------------------------------------------------
# LM chunks
# --------------------------------------------------------------------------------------------------
def test_lm_chunks_are_cut_at_the_size_asked_for(tmp_path, monkeypatch):
    """`chunk_chars` below the default cuts long documents into chunks of about that size, and a repeated chunk
    (a fortune in two files) is kept once."""
    paragraphs = [f"Paragraph {i}: " + "some words of a long novel " * 3 for i in range(40)]
    novel = "\n\n".join(paragraphs)
    monkeypatch.setattr(lm_data, "_lm_documents", lambda root: [
        ("austen/novel", novel), ("fortunes/a/0", "A fortune."), ("fortunes/b/0", "A fortune.")])
    splits = lm_data.load_lm_chunks(tmp_path, valid_frac=0.0, test_frac=0.0, chunk_chars=300)
    chunks = splits["train"]
    novel_chunks = [c["text"] for c in chunks if c["id"].startswith("austen/")]
    assert "\n\n".join(novel_chunks) == novel and len(novel_chunks) >= 10
    assert all(len(c) <= 300 + len(paragraphs[0]) for c in novel_chunks)
    assert [c["text"] for c in chunks].count("A fortune.") == 1


# --------------------------------------------------------------------------------------------------
# The loop's schedule
# --------------------------------------------------------------------------------------------------
def test_a_constant_schedule_still_warms_up():
    cfg = LoopConfig(steps=100, lr=1.0, warmup_steps=10, schedule="constant")
    assert learning_rate(cfg, 0) == pytest.approx(0.1) and learning_rate(cfg, 4) == pytest.approx(0.5)
    assert learning_rate(cfg, 9) == pytest.approx(1.0) and learning_rate(cfg, 99) == pytest.approx(1.0)
    assert learning_rate(cfg, 50, time_fraction=1.0) == pytest.approx(1.0)  # no decay, whatever the budget


# --------------------------------------------------------------------------------------------------
# Trainers: what they read, plan and record
# --------------------------------------------------------------------------------------------------
def test_an_lm_run_planned_in_epochs_counts_tokens(tmp_path):
    """`--epochs 1` is one pass over the training tokens: batch x context tokens a step."""
    cfg = lm.LMPreset(model=dict(d_model=16, n_heads=2, d_ff=32, n_layers=1), vocab_size=300, context=32,
                      batch_size=8, steps=500, loop=_loop(0), val_windows=2)
    corpus = {"train": LM_TEXTS, "valid": LM_TEXTS[:1]}
    lm.train(RunOptions(out=tmp_path, device="cpu", epochs=1.0), corpus=corpus, config=cfg)
    info = json.loads((tmp_path / "training.json").read_text())
    assert info["steps"] == max(1, round(info["data"]["train_tokens"] / (8 * 32))) < 50


def test_a_vit_is_not_trained_on_its_validation_images(tmp_path, monkeypatch):
    """The 5 % of the training images that validate (and pick the kept weights) are held out of the batches."""
    cfg = vit.ViTPreset(model=dict(d_model=16, n_heads=2, d_ff=32, n_layers=1, patch_size=7), batch_size=8,
                        epochs=1, loop=_loop(0), max_rotation=0, max_shift=0, scale=(1.0, 1.0))
    train_x, train_y = _images(80, 0)
    seen = []
    real = vit.batch_iterator

    def recording(x, y, batch_size, g):  # noqa: ANN001, ANN202
        seen.append(len(x))
        return real(x, y, batch_size, g)

    mask = vit.validation_split(train_y, 0.05)
    monkeypatch.setattr(vit, "batch_iterator", recording)
    vit.train(RunOptions(out=tmp_path, device="cpu", dataset="mnist-digits", steps=1),
              data={"train": (train_x, train_y), "test": _images(8, 1)}, config=cfg)
    info = json.loads((tmp_path / "training.json").read_text())
    assert mask.sum() > 0 and info["data"]["valid"] == mask.sum()
    assert seen == [80 - mask.sum()] and info["data"]["train"] + info["data"]["valid"] == 80


MT_SPLITS = {"train": PAIRS * 2, "valid": PAIRS[:2], "test": PAIRS[2:]}


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mt")
    cfg = translation.MTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1),
                               vocab_size=200, max_len=48, batch_tokens=400, epochs=1, loop=_loop(0))
    translation.train(RunOptions(out=out, device="cpu", steps=2), pairs=MT_SPLITS, config=cfg)
    return out


def test_a_translators_tokenizer_is_trained_on_both_languages(mt_run):
    """One shared vocabulary for English and German (tied embeddings): the trained tokenizer is the one BPE learns
    from both sides of the training pairs, so German words are as whole as English ones."""
    loaded = load(mt_run)
    both = bpe.train_translation_tokenizer((t for p in MT_SPLITS["train"] for t in (p.en, p.de)), vocab_size=200)
    assert loaded.tokenizer.backend.get_vocab() == both.backend.get_vocab()
    german = " ".join(p.de for p in PAIRS)
    assert len(loaded.tokenizer.encode(german)) == len(both.encode(german))


def test_a_translator_is_validated_on_the_validation_split_not_the_test_split(mt_run):
    """The test pairs stay unseen until `tserve eval`: the loss that picks the kept weights is the validation
    pairs'."""
    info = json.loads((mt_run / "training.json").read_text())
    loaded = load(mt_run)
    tok = loaded.tokenizer

    def nll(pairs):  # noqa: ANN001, ANN202
        return translation.mean_nll(loaded.model, translation.encode_pairs(tok, pairs, 48), tok.pad_id, tok.bos_id)

    assert info["kept_step"] == 2 and info["validation"][-1]["step"] == 2
    assert abs(nll(MT_SPLITS["valid"]) - nll(MT_SPLITS["test"])) > 1e-3
    assert info["validation"][-1]["val_loss"] == pytest.approx(nll(MT_SPLITS["valid"]), abs=1e-4)
    assert info["data"]["valid_pairs"] == 2 and info["data"]["test_pairs"] == 3


def test_a_pair_with_either_side_over_the_limit_is_left_out(mt_run):
    tok = load(mt_run).tokenizer
    short = TranslationPair("Good morning.", "Guten Morgen.", "ding")
    long_de = TranslationPair("Yes.", " ".join(["Guten Morgen."] * 12), "ding")
    long_en = TranslationPair(" ".join(["Good morning."] * 12), "Ja.", "ding")
    limit = 12
    assert len(tok.encode(short.en)) <= limit and len(tok.encode(long_de.en)) <= limit < len(tok.encode(long_de.de))
    for languages in (("en", "de"), ("de", "en")):
        kept = translation.encode_pairs(tok, [short, long_de, long_en], limit, languages)
        assert len(kept) == 1 and all(len(s) <= limit and len(t) <= limit for s, t in kept)
    assert len(translation.encode_pairs(tok, [short, long_de, long_en], None)) == 3


def _validation_data_logged(caplog) -> list[dict]:  # noqa: ANN001 - pytest's caplog
    return [{k: getattr(r, k) for k in ("validated_on", "train_items", "valid_items")}
            for r in caplog.records if getattr(r, "event", None) == "validation_data"]


def test_a_translator_without_a_validation_split_validates_on_pairs_held_out_of_training(tmp_path, monkeypatch,
                                                                                         caplog):
    """No validation split: a slice of the training pairs (5 %, at least one) is held out of the batches and the
    tokenizer, and the loss that picks the kept weights is theirs; the start's log line, training.json and the
    card say so."""
    cfg = translation.MTPreset(model=dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1),
                               vocab_size=200, max_len=48, batch_tokens=400, epochs=1, loop=_loop(0))
    encoded = []
    real = translation.encode_pairs

    def recording(tok, pairs, *args):  # noqa: ANN001, ANN202
        encoded.append(list(pairs))
        return real(tok, pairs, *args)

    monkeypatch.setattr(translation, "encode_pairs", recording)
    with caplog.at_level("INFO", logger="tserve"):
        translation.train(RunOptions(out=tmp_path, device="cpu", steps=1), pairs={"train": PAIRS}, config=cfg)
    trained, validated = encoded[:2]
    assert len(validated) == 1 and validated[0] not in trained and len(trained) + 1 == len(PAIRS)
    info = json.loads((tmp_path / "training.json").read_text())
    assert info["validated_on"] == "held-out" and info["data"]["valid_pairs"] == 1
    assert _validation_data_logged(caplog) == [{"validated_on": "held-out", "train_items": len(PAIRS) - 1,
                                                "valid_items": 1}]
    assert "Validated on training items held out of training" in (tmp_path / "MODEL_CARD.md").read_text()


def test_an_lm_of_one_text_without_a_validation_split_says_its_validation_is_on_training_text(tmp_path, caplog):
    """A single training text can spare none: the run validates on it, and the log line, training.json and the card
    say that the validation figures are training figures."""
    cfg = lm.LMPreset(model=dict(d_model=16, n_heads=2, d_ff=32, n_layers=1), vocab_size=300, context=32,
                      batch_size=2, steps=1, loop=_loop(1), val_windows=2)
    with caplog.at_level("INFO", logger="tserve"):
        lm.train(RunOptions(out=tmp_path, device="cpu"), corpus={"train": LM_TEXTS[:1] * 3}, config=cfg)
    assert json.loads((tmp_path / "training.json").read_text())["validated_on"] == "train"
    assert _validation_data_logged(caplog) == [{"validated_on": "train", "train_items": 3, "valid_items": 3}]
    assert "the validation figures are training figures" in (tmp_path / "MODEL_CARD.md").read_text()


# --------------------------------------------------------------------------------------------------
# Alignment heads: chosen on the validation split, reported on the test split
# --------------------------------------------------------------------------------------------------
def test_alignment_accuracy_is_reported_on_the_test_split(tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers import factories
    from tests.training.test_align_imported import _pairs
    from tserve.training import alignment

    d = factories.hf_nllb_dir(tmp_path / "nllb")
    valid, test = _pairs(0), _pairs(5)[:3]
    loaded = load(d)
    expected = alignment.copy_alignments(loaded, [(p.en, p.de) for p in test], 400, ("eng_Latn", "deu_Latn"))
    report = alignment.choose(d, write=False, splits={"valid": valid, "test": test}, source="en", target="de")
    assert report["valid_pairs"] >= 8 and report["test_pairs"] == len(expected) <= 3
    assert report["test_gold_tokens"] == sum(len(e.gold) for e in expected)
