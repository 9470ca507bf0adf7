"""Evaluation, model cards and adoption beyond their default configuration: a German → English translator
evaluated on its test split (its references, its Ding everyday sentences, its probes, the reference slice its card
records and the card's title), the bigram baseline's add-k chosen on validation text, the card's notes for one
quantized format alone and for a continued run's total time, `eval --no-write`, and `adopt` of translators and of
language models with and without `--limit`. Tiny committed checkpoints and a tiny processed data set; seconds."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.factories import tiny_lm_dir, tiny_mt_dir
from tests.training.test_option_combinations_training import _write_lm_data
from tserve.model.checkpoint import load
from tserve.training import cli, evaluate
from tserve.training.adopt import adopt
from tserve.training.adopt import main as adopt_main
from tserve.training.card import render_card
from tserve.training.data import looks_like_sentence
from tserve.training.data.sources import PROCESSING_VERSION, TRANSLATION_TEST_FRAC, TRANSLATION_VALID_FRAC

# (en, de, source): lexicon phrases the tiny translators know, two of the Ding pairs everyday sentences.
TEST_PAIRS = [("the quick brown fox", "der schnelle braune Fuchs", "ding"),
              ("Good morning.", "Guten Morgen.", "ding"),
              ("where is the station", "wo ist der Bahnhof", "ding"),
              ("The weather is nice today.", "Das Wetter ist heute schön.", "ding"),
              ("the lazy dog", "der faulen Hund", "lo-ui"),
              ("hello world", "Hallo Welt", "lo-help"),
              ("the king know three daughters", "der König weiß drei Töchter", "ding"),
              ("small time", "kleiner Zeit", "ding")]
SLICE = 3  # the reference slice's size here (the test split has fewer items than the real one's 40)
GPU = "NVIDIA H200 (CUDA 13.0)"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> str:
    """A processed data set: the LM corpus of test_option_combinations_training and TEST_PAIRS as every split."""
    root = tmp_path_factory.mktemp("data")
    _write_lm_data(root)
    tag = f"translation-v{PROCESSING_VERSION}-{TRANSLATION_VALID_FRAC:g}-{TRANSLATION_TEST_FRAC:g}"
    lines = "".join(json.dumps({"en": en, "de": de, "source": src}) + "\n" for en, de, src in TEST_PAIRS)
    for split in ("train", "valid", "test"):
        (root / "processed" / f"{tag}-{split}.jsonl").write_text(lines)
    return str(root)


@pytest.fixture(scope="module")
def de_en_evaluated(tmp_path_factory, data_root):  # noqa: ANN201
    """A German → English translator after a full `eval` (written): (directory, metrics, loaded model)."""
    ckpt = tiny_mt_dir(tmp_path_factory.mktemp("de-en") / "tserve-de-en", reverse=True, languages=("de", "en"))
    (ckpt / "training.json").write_text(json.dumps({"task": "translation"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(evaluate.REFERENCE_SLICE, "translation", SLICE)
        metrics = evaluate.evaluate_checkpoint(ckpt, device="cpu", data_root=data_root)
    return ckpt, metrics, load(ckpt, device="cpu")


def _scores(hyps: list[str], refs: list[str]) -> tuple[float, float]:
    return (round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2), round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2))


def test_a_german_to_english_translator_is_scored_against_the_english_references(de_en_evaluated):
    """The test pairs are read the model's way: German sources in, English references to score against (the
    German side as references would score English output near zero)."""
    _, metrics, loaded = de_en_evaluated
    hyps = evaluate.translate(loaded, [de for _, de, _ in TEST_PAIRS])
    assert (metrics["bleu"], metrics["chrf"]) == _scores(hyps, [en for en, _, _ in TEST_PAIRS])
    assert metrics["bleu"] > 20 and metrics["n"] == len(TEST_PAIRS)
    assert set(metrics["by_source"]) == {"ding", "lo-ui", "lo-help"} and metrics["by_source"]["ding"]["n"] == 6
    probes = evaluate.PROBES["de"]  # the probes are German too, and shown with their own translations
    expected = [[p, out] for p, out in zip(probes, evaluate.translate(loaded, probes), strict=True)]
    assert [s[:2] for s in metrics["samples"][: len(probes)]] == expected


def test_the_ding_figures_are_those_of_its_everyday_sentences_alone(de_en_evaluated):
    """`ding_sentences` (what adoption's chrF rule reads) scores the Ding pairs that look like sentences, not
    every Ding phrase."""
    _, metrics, loaded = de_en_evaluated
    chosen = [(en, de) for en, de, src in TEST_PAIRS if src == "ding" and looks_like_sentence(en)]
    assert len(chosen) == 2
    hyps = evaluate.translate(loaded, [de for _, de in chosen])
    ding = metrics["ding_sentences"]
    assert ding["n"] == 2 and (ding["bleu"], ding["chrf"]) == _scores(hyps, [en for en, _ in chosen])
    assert [(s[0], s[2]) for s in metrics["samples"][-2:]] == [
        ("Guten Morgen.", "(reference: Good morning.)"),
        ("Das Wetter ist heute schön.", "(reference: The weather is nice today.)")]


def test_the_reference_slice_is_the_first_items_translated_the_models_way(de_en_evaluated):
    """A full evaluation records the figures of its first REFERENCE_SLICE items (what test_bundled_models
    reproduces): those items' own figures, their German sides translated."""
    ckpt, metrics, loaded = de_en_evaluated
    first = TEST_PAIRS[:SLICE]
    hyps = evaluate.translate(loaded, [de for _, de, _ in first])
    bleu, chrf = _scores(hyps, [en for en, _, _ in first])
    assert metrics["reference_slice"] == {"limit": SLICE, "bleu": bleu, "chrf": chrf}
    assert json.loads((ckpt / "metrics.json").read_text())["reference_slice"]["bleu"] == bleu
    assert bleu != metrics["bleu"]  # the slice is told apart from the whole split


def test_the_card_of_a_german_to_english_translator_names_its_direction(de_en_evaluated):
    ckpt, metrics, _ = de_en_evaluated
    card = (ckpt / "MODEL_CARD.md").read_text()
    assert "German → English translation" in card and "English → German" not in card
    assert f"| bleu | {metrics['bleu']:.4g} |" in card


def test_the_bigram_add_k_is_chosen_on_validation_text_not_on_the_test_split():
    """The bigram baseline's k is model selection: tuned on validation ids, the test ids only scored. Here the
    validation text favours a large k (unseen continuations) and the test text a small one."""
    train = np.array([0, 1] * 20)
    test = np.array([0, 1] * 5)
    valid = np.array([0, 2] * 3)
    m = evaluate.ngram_baselines(train, test, vocab_size=4, valid_ids=valid, ks=(1.0, 0.001))
    assert m["bigram_k"] == 1.0
    # at k = 1: p(1 | 0) = (20 + 1) / (20 + 4) five times, p(0 | 1) = (19 + 1) / (19 + 4) four times
    nll = -(5 * np.log(21 / 24) + 4 * np.log(20 / 23)) / 9
    assert m["bigram_ppl"] == pytest.approx(np.exp(nll), abs=0.01)
    assert evaluate.ngram_baselines(train, test, vocab_size=4, ks=(1.0, 0.001))["bigram_k"] == 0.001


@pytest.mark.parametrize("key", ["int8_split", "int8_7bit"])
def test_the_card_explains_an_int8_format_stored_without_plain_int8(tmp_path, key):
    """`eval --quantize int8 --int8-activations split` alone stores `int8_split` only: the card still says what
    those figures are."""
    ckpt = tiny_mt_dir(tmp_path / "mt")
    (ckpt / "metrics.json").write_text(json.dumps({"bleu": 30.0, key: {"limit": None, "bleu": 29.5}}))
    card = render_card(ckpt)
    assert f"| {key}.bleu | 29.5 |" in card and f"`{key}.*`" in card


def test_the_card_of_a_continued_run_counts_this_runs_time_in_the_total(tmp_path):
    ckpt = tiny_mt_dir(tmp_path / "mt")
    earlier = {"command": "train translation", "steps": 100, "seconds": 60.0}
    (ckpt / "training.json").write_text(json.dumps({"task": "translation", "seconds": 120.0, "steps": 50,
                                                    "continued_from": earlier}))
    card = render_card(ckpt)
    assert "continued from 1 earlier run (3.0 min in all, this one included)" in card
    assert "- `train translation`: 100 steps, 1.0 min" in card and "| wall time | 2.0 min |" in card


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int4"]])
def test_eval_no_write_prints_the_figures_and_leaves_the_checkpoint_alone(tmp_path, data_root, capsys, quantize):
    ckpt = tiny_lm_dir(tmp_path / "lm")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert cli.main(["eval", str(ckpt), "--no-write", "--limit", "2", "--device", "cpu", "--data-dir", data_root,
                     *quantize]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["limit"] == 2 and printed["perplexity"] > 1 and ("group_size" in printed) == bool(quantize)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


# --------------------------------------------------------------------------------------------------
# Adoption
# --------------------------------------------------------------------------------------------------
def _returned(tmp: Path, name: str, weights: Path) -> Path:
    out = tmp / "returned"
    out.mkdir()
    shutil.copyfile(weights, out / f"{name}.safetensors")
    body = json.dumps({"task": "lm" if name == "lm" else "translation", "hardware": GPU, "seconds": 60}).encode()
    with tarfile.open(out / "train-records.tar.gz", "w:gz") as tar:
        member = tarfile.TarInfo(f"./{name}/training.json")
        member.size = len(body)
        tar.addfile(member, io.BytesIO(body))
    return out


def test_adoption_judges_a_translator_by_the_chrf_of_its_everyday_sentences(tmp_path, data_root):
    """The bundled translator's side is evaluated as fully as the candidate's: both report the Ding sentences'
    chrF, so that a candidate losing on them is not installed."""
    bundled = tiny_mt_dir(tmp_path / "models" / "tserve-en-de")
    returned = _returned(tmp_path, "en-de", bundled / "model.safetensors")
    [row] = adopt(returned, tmp_path / "models", limit=6, data_root=data_root, install=False)
    assert row["old"] == row["new"] and row["old"]["ding_chrf"] is not None and row["not_judged_by"] == {}
    assert row["better"] is False and row["installed"] is False


def test_adoption_under_a_limit_holding_no_ding_sentence_says_its_chrf_rule_was_not_applied(tmp_path, data_root,
                                                                                           capsys, caplog):
    """The first test item is a Ding phrase, not a sentence: `--limit 1` leaves the chrF rule nothing to read. The
    better candidate is still installed on BLEU alone, and the printed verdict, the log and the card's note say
    which rule was not applied and why."""
    good = tiny_mt_dir(tmp_path / "good")
    bundled = shutil.copytree(good, tmp_path / "models" / "tserve-en-de")
    weights = load_file(bundled / "model.safetensors")
    torch.manual_seed(0)
    save_file({k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()},
              bundled / "model.safetensors")
    returned = _returned(tmp_path, "en-de", good / "model.safetensors")
    with caplog.at_level("INFO", logger="tserve"):
        assert adopt_main([str(returned), "--models", str(bundled.parent), "--data-dir", data_root,
                           "--limit", "1"]) == 0
    why = "no Ding example sentence among the first 1 test items"
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| tserve-en-de |") and f"| the Ding sentences' chrF ({why}) | True | True |" in row
    [logged] = [r for r in caplog.records if getattr(r, "event", None) == "adoption"]
    assert logged.not_judged_by == {"the Ding sentences' chrF": why} and logged.installed
    assert f"Not judged by the Ding sentences' chrF: {why}." in (bundled / "MODEL_CARD.md").read_text()


@pytest.fixture
def worse_bundled_lm(tmp_path):  # noqa: ANN201
    """models/tserve-lm holding the tiny LM's weights made worse, with int8 figures and a card of its own; and the
    tiny LM's own weights returned as the candidate."""
    good = tiny_lm_dir(tmp_path / "good")
    bundled = shutil.copytree(good, tmp_path / "models" / "tserve-lm")
    weights = load_file(bundled / "model.safetensors")
    torch.manual_seed(0)
    save_file({k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()},
              bundled / "model.safetensors")
    (bundled / "metrics.json").write_text(json.dumps({"perplexity": 99.0, "int8": {"perplexity": 98.0}}))
    return bundled, _returned(tmp_path, "lm", good / "model.safetensors")


@pytest.mark.parametrize("limit", [None, 2])
def test_an_installed_language_model_brings_only_its_own_figures(worse_bundled_lm, data_root, limit):
    """A better LM is installed with its own test figures (a full evaluation) or none (a `--limit`ed one, whose
    figures describe no model); never the replaced weights' perplexity or int8 figures. The card's note gives the
    change from the bundled figure to the candidate's."""
    bundled, returned = worse_bundled_lm
    [row] = adopt(returned, bundled.parent, limit=limit, data_root=data_root)
    assert row["installed"] and row["new"]["perplexity"] < row["old"]["perplexity"]
    assert (bundled / "model.safetensors").read_bytes() == (returned / "lm.safetensors").read_bytes()
    card = (bundled / "MODEL_CARD.md").read_text()
    assert f"perplexity {row['old']['perplexity']} → {row['new']['perplexity']}" in card and GPU in card
    if limit is None:
        metrics = json.loads((bundled / "metrics.json").read_text())
        assert metrics["perplexity"] == row["new"]["perplexity"] and metrics["limit"] is None
        assert not any(k.startswith("int8") for k in metrics) and "98" not in card
    else:
        assert not (bundled / "metrics.json").exists() and "Not evaluated yet" in card and "99.0" not in card
