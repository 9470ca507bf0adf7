"""Training side: tokenizer training, the loop, the three trainers on tiny configs, evaluation, cards, CLI.
Everything runs on CPU in seconds with synthetic or inline data (no downloads)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
from PIL import Image

from tests.helpers.one_request import lm_tokens
from tserve.model.attention import Attention
from tserve.model.checkpoint import load
from tserve.model.config import DecoderConfig, Seq2SeqConfig, ViTConfig
from tserve.model.decoder import Decoder
from tserve.model.decoding import SamplingParams
from tserve.model.preprocessing import ImagePreprocessing
from tserve.model.seq2seq import Seq2Seq
from tserve.model.tokenizer import load_tokenizer
from tserve.model.vit import ViT
from tserve.testing.corpus import DE, EN
from tserve.training import bpe, cli, evaluate, lm, translation, vit
from tserve.training.card import render_card
from tserve.training.common import RunOptions, count_parameters, planned_steps, set_dropout
from tserve.training.data import TranslationPair
from tserve.training.loop import LoopConfig, learning_rate, train_loop

ROOT = Path(__file__).resolve().parents[2]

PAIRS = [TranslationPair(en, de, "ding") for en, de in zip(EN, DE, strict=True)]
LM_TEXTS = [" ".join(EN * 4), " ".join(reversed(EN)) * 3, "To be, or not to be: that is the question."] * 4


def _loop(steps: int, lr: float = 3e-3) -> LoopConfig:
    return LoopConfig(steps=steps, lr=lr, warmup_steps=2, eval_every=10_000, log_every=10_000)


def _loss_drop(model, batch, loss_fn, steps: int = 40, lr: float = 3e-3) -> tuple[float, float]:
    torch.manual_seed(0)
    with torch.no_grad():
        before = float(loss_fn(model.eval(), batch)[0])
    train_loop(model, itertools.repeat(batch), loss_fn, _loop(steps, lr), device=torch.device("cpu"))
    with torch.no_grad():
        after = float(loss_fn(model.eval(), batch)[0])
    return before, after


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------
def test_translation_tokenizer_round_trip(tmp_path):
    tok = bpe.train_translation_tokenizer((EN + DE) * 5, vocab_size=300, min_frequency=1)
    assert [tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id] == [0, 1, 2, 3]
    text = "Guten Morgen. Where is the station?"
    ids = tok.encode(text)
    assert ids[-1] == tok.eos_id and tok.bos_id not in ids
    assert tok.decode(ids) == text
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(text) == ids and again.decode(ids) == text
    assert tok.unk_id in tok.encode("日本")  # symbols never seen map to <unk>


def test_lm_tokenizer_is_byte_level_and_lossless(tmp_path):
    tok = bpe.train_lm_tokenizer(LM_TEXTS, vocab_size=400, min_frequency=1)
    assert tok.eos_id == tok.bos_id == 0
    for text in ["To be, or not to be.", "naïve café — 日本 🙂\n\n  indented"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.eos_id not in ids
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).encode("To be") == tok.encode("To be")
    stream = lm.token_stream(tok, ["ab", "cd"])
    assert stream.tolist().count(0) == 2 and stream[-1] == 0


# --------------------------------------------------------------------------------------------------
# Loop pieces
# --------------------------------------------------------------------------------------------------
def test_learning_rate_schedules():
    cfg = LoopConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(cfg, 0) == pytest.approx(0.1) and learning_rate(cfg, 9) == pytest.approx(1.0)
    assert learning_rate(cfg, 99) == pytest.approx(0.1)
    assert all(learning_rate(cfg, s) >= learning_rate(cfg, s + 1) for s in range(10, 99))
    assert learning_rate(cfg, 20, time_fraction=1.0) == pytest.approx(0.1)  # the time budget ends the run
    assert learning_rate(cfg, 20, time_fraction=0.01) == pytest.approx(learning_rate(cfg, 20))
    vas = LoopConfig(steps=100, lr=1.0, warmup_steps=16, schedule="vaswani")
    assert learning_rate(vas, 15) == pytest.approx(1.0) and learning_rate(vas, 63) == pytest.approx(0.5)


def test_planned_steps_priorities(tmp_path):
    opts = RunOptions(out=tmp_path)
    assert planned_steps(opts, 7, None, 1000, 10) == 7
    assert planned_steps(opts, None, 2.0, 1000, 10) == 200
    assert planned_steps(RunOptions(out=tmp_path, epochs=0.5), 7, 2.0, 1000, 10) == 50
    assert planned_steps(RunOptions(out=tmp_path, steps=3, epochs=0.5), 7, 2.0, 1000, 10) == 3


def test_time_budget_stops_and_validates(tmp_path):
    model = ViT(ViTConfig(image_size=8, patch_size=4, d_model=16, n_heads=2, d_ff=32, n_layers=1, n_classes=2))
    batch = (torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 0, 1]))
    loss_fn = lambda m, b: (torch.nn.functional.cross_entropy(m(b[0]), b[1]), 4)  # noqa: E731
    saved = []
    cfg = _loop(1000)
    cfg.max_minutes = 1e-9
    result = train_loop(model, itertools.repeat(batch), loss_fn, cfg, device=torch.device("cpu"),
                        validate=lambda m: {"val_loss": 1.0}, save=lambda m, s: saved.append(s))
    assert result.steps == 1 and result.stopped_early and saved == [1] and result.validations[0]["val_loss"] == 1.0


def test_a_worse_validation_leaves_the_best_checkpoint_on_disk():
    model = torch.nn.Linear(2, 1)
    batch = torch.randn(4, 2)
    losses = iter([3.0, 1.0, 2.0, 1.5])  # best at step 2; the last validation is worse than it
    saved = []
    cfg = _loop(4)
    cfg.eval_every = 1
    result = train_loop(model, itertools.repeat(batch), lambda m, b: (m(b).pow(2).mean(), 4), cfg,
                        device=torch.device("cpu"), validate=lambda m: {"val_loss": next(losses)},
                        save=lambda m, s: saved.append(s))
    assert saved == [1, 2] and result.kept_step == 2 and result.steps == 4
    cfg.eval_every, cfg.checkpoint_every = 2, 1  # a periodic checkpoint may not overwrite the best one either
    losses, saved = iter([1.0, 2.0]), []
    result = train_loop(model, itertools.repeat(batch), lambda m, b: (m(b).pow(2).mean(), 4), cfg,
                        device=torch.device("cpu"), validate=lambda m: {"val_loss": next(losses)},
                        save=lambda m, s: saved.append(s))
    assert saved == [2] and result.kept_step == 2


@pytest.mark.parametrize(("values", "start", "higher", "kept"), [
    ([1.0, 2.0, 3.0], True, False, [0]),  # continued training that only gets worse: the starting weights stay
    ([3.0, 2.0, 2.5], True, False, [0, 1]),
    ([float("nan"), 2.0, float("nan")], False, False, [1, 2]),  # a NaN is kept first, then beaten, never kept after
    ([0.5, 0.7, 0.6], False, True, [1, 2]),  # accuracy: higher is better
])
def test_which_validations_are_kept(values, start, higher, kept):
    model = torch.nn.Linear(2, 1)
    cfg = _loop(3 if start else 2)
    cfg.eval_every = 1
    cfg.steps = len(values) - 1 if start else len(values)
    scores, saved = iter(values), []
    train_loop(model, itertools.repeat(torch.randn(4, 2)), lambda m, b: (m(b).pow(2).mean(), 4), cfg,
               device=torch.device("cpu"), validate=lambda m: {"val_loss": next(scores)},
               save=lambda m, s: saved.append(s), higher_is_better=higher, start_checkpoint=start)
    assert saved == kept


def test_without_validation_the_last_weights_are_saved():
    saved = []
    cfg = _loop(5)
    train_loop(torch.nn.Linear(2, 1), itertools.repeat(torch.randn(4, 2)), lambda m, b: (m(b).pow(2).mean(), 4),
               cfg, device=torch.device("cpu"), save=lambda m, s: saved.append(s))
    assert saved == [5]


# --------------------------------------------------------------------------------------------------
# Each task learns a fixed batch
# --------------------------------------------------------------------------------------------------
def test_vit_loss_decreases_on_fixed_batch():
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=28, patch_size=7, d_model=32, n_heads=4, d_ff=64, n_layers=2, n_classes=4))
    batch = (torch.randn(16, 1, 28, 28), torch.arange(16) % 4)
    loss_fn = lambda m, b: (torch.nn.functional.cross_entropy(m(b[0]), b[1]), len(b[1]))  # noqa: E731
    before, after = _loss_drop(model, batch, loss_fn)
    assert after < 0.5 * before


def test_lm_loss_decreases_on_fixed_batch():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_seq_len=32))
    batch = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    before, after = _loss_drop(model, batch, lambda m, b: lm.lm_loss(m, b, torch.device("cpu")))
    assert after < 0.6 * before


def test_translation_loss_decreases_on_fixed_batch():
    tok = bpe.train_translation_tokenizer((EN + DE) * 5, vocab_size=200, min_frequency=1)
    examples = translation.encode_pairs(tok, PAIRS)
    batch = translation.collate(examples, tok.pad_id, tok.bos_id)
    src, lengths, tgt_in, labels = batch
    assert (tgt_in[:, 0] == tok.bos_id).all() and (labels[lengths.new_tensor(range(len(examples))), 0] >= 0).all()
    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1,
                                  n_decoder_layers=1, max_source_len=64, max_target_len=64, pad_token_id=tok.pad_id,
                                  eos_token_id=tok.eos_id, decoder_start_token_id=tok.bos_id))
    before, after = _loss_drop(model, batch, lambda m, b: translation.mt_loss(m, b, torch.device("cpu"), 0.0),
                               steps=60, lr=5e-3)
    assert after < 0.5 * before


def test_translation_batches_respect_token_budget():
    examples = [([1] * n, [2] * (n + 1)) for n in range(1, 40)]
    batches = translation.make_batches(examples, 60, torch.Generator().manual_seed(0))
    assert sorted(i for b in batches for i in b) == list(range(len(examples)))
    for b in batches:
        longest = max(len(examples[i][0]) for i in b) + max(len(examples[i][1]) for i in b) + 1
        assert len(b) == 1 or len(b) * longest <= 60
    assert max(map(len, batches)) > 1  # short examples do share batches


def test_vit_augment_keeps_shape_and_range():
    pixels = torch.rand(8, 1, 28, 28)
    out = vit.augment(pixels, vit.preset("fashion-mnist", "cpu"), torch.Generator().manual_seed(0))
    assert out.shape == pixels.shape and out.min() >= 0 and out.max() <= 1.0001
    assert not torch.allclose(out, pixels, atol=1e-3)  # it did transform the images
    dim = vit.ViTPreset(model={}, contrast=(0.5, 0.5), max_rotation=0, max_shift=0, scale=(1.0, 1.0))
    assert torch.allclose(vit.augment(pixels, dim, torch.Generator()), pixels * 0.5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Preprocessing of user images
# --------------------------------------------------------------------------------------------------
def test_content_fit_turns_dark_on_light_photo_into_mnist_format():
    pre = vit.preprocessing_for("mnist-digits")
    photo = np.full((300, 200, 3), 230, dtype=np.uint8)  # light grey paper, colour image
    photo[200:280, 40:60] = 20  # a dark vertical stroke near the bottom
    noise = np.random.default_rng(0).normal(0, 8, photo.shape)  # sensor noise must not move the crop
    photo = np.clip(photo + noise, 0, 255).astype(np.uint8)
    out = np.asarray(pre.to_image(Image.fromarray(photo)))
    assert out.shape == (28, 28)
    assert out[0].max() == 0 and out[:, 0].max() == 0  # black background
    rows, cols = np.nonzero(out > 128)
    assert rows.min() >= 3 and rows.max() <= 24  # scaled into the 20-pixel box, centred
    assert abs((cols.min() + cols.max()) / 2 - 13.5) <= 1.5
    same = np.asarray(pre.to_image(Image.fromarray(255 - photo[:, :, 0])))  # light-on-dark, greyscale
    assert np.abs(same.astype(int) - out.astype(int)).mean() < 5
    tensor = pre(Image.fromarray(photo))
    assert tensor.shape == (1, 28, 28)


def test_preprocessing_options_round_trip(tmp_path):
    pre = vit.preprocessing_for("fashion-mnist")
    pre.save(tmp_path / "p.json")
    assert ImagePreprocessing.load(tmp_path / "p.json") == pre
    with pytest.raises(ValueError):
        ImagePreprocessing(28, 1, (0.5,), (0.5,), fit="crop")
    blank = ImagePreprocessing(28, 1, (0.5,), (0.5,), fit="content", autocontrast=True)
    assert np.asarray(blank.to_image(Image.new("L", (50, 50), 0))).max() == 0


# --------------------------------------------------------------------------------------------------
# Tiny end-to-end runs: checkpoint, load, outputs, evaluation, card
# --------------------------------------------------------------------------------------------------
def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Four easy classes that survive the digits' content crop (which drops size and position): a
    horizontal bar, a vertical bar, a hollow frame and a filled square, each of a random size at a random
    place on a faint noisy background."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 4
    x = rng.integers(0, 30, size=(n, 28, 28)).astype(np.uint8)
    for i, c in enumerate(y):
        size = int(rng.integers(10, 20))
        width = max(2, size // 5)
        r, q = (int(v) for v in rng.integers(2, 26 - size, size=2))
        if c == 0:
            x[i, r : r + width, q : q + size] = 255
        elif c == 1:
            x[i, r : r + size, q : q + width] = 255
        else:
            x[i, r : r + size, q : q + size] = 255
            if c == 2:
                x[i, r + width : r + size - width, q + width : q + size - width] = 0
    return x, y.astype(np.int64)


@pytest.fixture(scope="module")
def tiny_vit_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vit-run")
    cfg = vit.ViTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_layers=1, patch_size=7), batch_size=32,
                        epochs=6, loop=_loop(0), max_rotation=0, max_shift=0, scale=(1.0, 1.0))
    data = {"train": _images(200, 0), "test": _images(40, 1)}
    vit.train(RunOptions(out=out, device="cpu", dataset="mnist-digits", command="pytest"), data=data, config=cfg)
    return out, data


@pytest.mark.slow  # 3-10 s: its fixture trains a ViT for six epochs
def test_vit_checkpoint_loads_and_classifies(tiny_vit_run):
    out, data = tiny_vit_run
    loaded = load(out)
    assert loaded.labels == [str(i) for i in range(10)] and loaded.preprocessing.fit == "content"
    x, y = data["test"]
    with torch.no_grad():  # the serving path, image by image: PIL image -> preprocessing -> model
        preds = np.array([int(loaded.model(loaded.preprocessing(Image.fromarray(img))[None]).argmax(-1))
                          for img in x])
    metrics = evaluate.evaluate_vit(loaded, x, y)
    assert metrics["n"] == 40 and metrics["accuracy"] == pytest.approx(float((preds == y).mean()), abs=1e-4)
    assert metrics["accuracy"] >= 0.75  # chance is 0.25: the four shapes were learnt
    for c in range(4):
        assert metrics["per_class_accuracy"][str(c)] == pytest.approx(float((preds[y == c] == c).mean()), abs=1e-4)
    # Scored against its own predictions, then against labels it never gives: all right, all wrong.
    assert evaluate.evaluate_vit(loaded, x, preds, inverted=False)["accuracy"] == 1.0
    assert evaluate.evaluate_vit(loaded, x, (preds + 1) % 10, inverted=False)["accuracy"] == 0.0
    assert json.loads((out / "training.json").read_text())["task"] == "vit"
    assert "## Training" in (out / "MODEL_CARD.md").read_text()


@pytest.fixture(scope="module")
def tiny_lm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm-run")
    cfg = lm.LMPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_layers=2), vocab_size=300, context=32,
                      batch_size=8, steps=60, loop=_loop(60, lr=1e-2), val_windows=4)
    corpus = {"train": LM_TEXTS, "valid": LM_TEXTS[:2], "test": LM_TEXTS[2:4]}
    lm.train(RunOptions(out=out, device="cpu", command="pytest"), corpus=corpus, config=cfg)
    return out, corpus


def test_lm_checkpoint_generates_and_evaluates(tiny_lm_run):
    out, corpus = tiny_lm_run
    loaded = load(out)
    # "is" follows three different words in the corpus: the continuation depends on more than the last token.
    prompt, eos = loaded.tokenizer.encode("Where is"), loaded.model.cfg.eos_token_id
    ids = lm_tokens(loaded, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    expected: list[int] = []  # greedy by hand: the whole sequence through the model at every step, no cache
    with torch.no_grad():
        while len(expected) < 8 and eos not in expected:
            expected.append(int(loaded.model(torch.tensor([prompt + expected]))[0, -1].argmax()))
    assert ids == expected
    metrics = evaluate.evaluate_lm(loaded, corpus["test"], corpus["train"], corpus["valid"])
    assert metrics["perplexity"] < metrics["unigram_ppl"]  # memorised repetitive text
    assert len(metrics["samples"]) == len(evaluate.LM_PROMPTS)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 20])
def test_strided_windows_score_every_token_once(n):
    stream = np.arange(100, 100 + n)
    inputs, targets = lm.strided_windows(stream, context=4, stride=2)
    scored = targets[targets != -100].tolist()
    assert scored == stream[1:].tolist()
    for inp, tgt in zip(inputs, targets, strict=True):  # each target follows its input token
        keep = tgt != -100
        assert (tgt[keep] == inp[keep] + 1).all()


def test_lm_training_continues_from_a_checkpoint(tiny_lm_run, tmp_path):
    out, corpus = tiny_lm_run
    cfg = lm.LMPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_layers=2), vocab_size=300, context=32,
                      batch_size=8, steps=5, loop=_loop(5), val_windows=4)
    cfg.loop.eval_every = 1
    lm.train(RunOptions(out=tmp_path, device="cpu", command="again", init_from=str(out), batch=3), corpus=corpus,
             config=cfg)
    info = json.loads((tmp_path / "training.json").read_text())
    assert info["continued_from"]["command"] == "pytest" and info["steps"] == 5
    assert info["hyperparameters"]["batch_size"] == 3 and info["tokens_seen"] == 5 * 3 * cfg.context
    # The starting weights are validated first (step 0); the weights on disk are those of the best validation.
    losses = [row["val_loss"] for row in info["validation"]]
    assert [row["step"] for row in info["validation"]] == [0, 1, 2, 3, 4, 5]
    assert info["kept_step"] == info["validation"][losses.index(min(losses))]["step"]
    kept = load(tmp_path)
    from tserve.training.lm import eval_windows, mean_nll, token_stream
    val = eval_windows(token_stream(kept.tokenizer, corpus["valid"]), cfg.context, cfg.val_windows)
    assert mean_nll(kept.model, val)[0] == pytest.approx(min(losses), abs=1e-4)
    assert (tmp_path / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    assert "continued from 1 earlier run" in (tmp_path / "MODEL_CARD.md").read_text()
    third = tmp_path / "third"
    lm.train(RunOptions(out=third, device="cpu", command="third", init_from=str(tmp_path)), corpus=corpus, config=cfg)
    lineage = json.loads((third / "training.json").read_text())["continued_from"]
    assert lineage["command"] == "again" and lineage["continued_from"]["command"] == "pytest"
    card = (third / "MODEL_CARD.md").read_text()
    assert "continued from 2 earlier runs" in card and card.index("`pytest`") < card.index("`again`")
    with pytest.raises(ValueError):
        translation.train(RunOptions(out=tmp_path / "x", device="cpu", init_from=str(out)), pairs={"train": PAIRS})


def test_ngram_baselines_match_hand_computation():
    train = np.array([0, 1, 0, 1, 0, 2])
    test = np.array([0, 1, 2])
    m = evaluate.ngram_baselines(train, test, vocab_size=3, ks=(1.0,))
    uni = (np.bincount(train, minlength=3) + 1) / (len(train) + 3)
    assert m["unigram_ppl"] == pytest.approx(math.exp(-np.log(uni[[1, 2]]).mean()), abs=0.01)
    # bigram add-1: p(1|0) = (2+1)/(3+3), p(2|1) = (0+1)/(2+3)
    assert m["bigram_ppl"] == pytest.approx(math.exp(-(math.log(3 / 6) + math.log(1 / 5)) / 2), abs=0.01)


@pytest.fixture(scope="module")
def tiny_mt_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mt-run")
    cfg = translation.MTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1),
                               vocab_size=200, max_len=48, batch_tokens=400, epochs=60, loop=_loop(0))
    pairs = {"train": PAIRS * 2, "valid": PAIRS[:2], "test": PAIRS[:3]}
    translation.train(RunOptions(out=out, device="cpu", command="pytest"), pairs=pairs, config=cfg)
    return out, pairs


def test_translation_checkpoint_translates_and_evaluates(tiny_mt_run, tmp_path):
    out, pairs = tiny_mt_run
    loaded = load(out)
    assert loaded.generation.num_beams == 4 and loaded.tokenizer.pad_id in loaded.generation.banned_token_ids
    metrics = evaluate.evaluate_translation(loaded, pairs["test"], num_beams=2)
    # The scores are sacrebleu's corpus scores of these very translations against the references.
    hyps, refs = evaluate.translate(loaded, [p.en for p in pairs["test"]], 2), [p.de for p in pairs["test"]]
    assert metrics["n"] == 3 and metrics["num_beams"] == 2
    assert metrics["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.01)
    assert metrics["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=0.01)
    assert metrics["by_source"]["ding"] == {"bleu": metrics["bleu"], "chrf": metrics["chrf"], "n": 3}
    info = json.loads((out / "training.json").read_text())
    assert info["final_loss"] < math.log(loaded.tokenizer.vocab_size)  # it learnt something
    assert {"ding"} == set(metrics["by_source"]) and metrics["samples"][0][0] == evaluate.PROBES["en"][0]
    (out / "metrics.json").write_text(json.dumps({"task": "translation", **metrics}))
    card = render_card(out)
    assert "bleu" in card and "dict-freedict-eng-deu" in card and "GPL-3+" in card
    assert "Best validation" not in card  # the last validation's weights are the ones kept
    copy = shutil.copytree(out, tmp_path / "copy")
    info |= {"kept_step": 1, "validation": [{"step": 1, "val_loss": 2.5}, {"step": 2, "val_loss": 2.75}]}
    (copy / "training.json").write_text(json.dumps(info))
    card = render_card(copy)
    assert "| weights kept from step | 1 |" in card and "Best validation (the weights kept): step 1, val_loss 2.5" in card


def test_bleu_and_chrf_of_right_and_wrong_translations():
    refs = [p.de for p in PAIRS[:3]]
    score = lambda hyps: evaluate.bleu_chrf(hyps, refs)  # noqa: E731
    assert score(refs) == {"bleu": 100.0, "chrf": 100.0, "n": 3}
    half = score([r[: len(r) // 2] for r in refs])  # the first half of each reference
    shuffled = score(refs[1:] + refs[:1])  # fluent German, each for another sentence
    nonsense = score(["x y z"] * 3)
    for key in ("bleu", "chrf"):
        assert 100 > half[key] > shuffled[key] > nonsense[key] >= 0, key
    assert nonsense["bleu"] == 0.0 and score([]) == {"bleu": None, "chrf": None, "n": 0}


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def test_cli_registers_train_and_eval():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", "vit", "--dataset", "mnist-digits", "--steps", "5", "--device", "cpu",
                              "--preset", "gpu", "--seed", "3", "--max-minutes", "1.5"])
    assert args.func is cli.run_train and args.task == "vit" and args.steps == 5 and args.max_minutes == 1.5
    assert cli.default_out(args.task, args.dataset) == "models/tserve-vit-digits"
    assert cli.default_out("translation", None) == "models/tserve-en-de"
    # Continuing German → English: its own directory, not the English → German one.
    assert cli.inherited_direction(str(ROOT / "models" / "tserve-de-en")) == "de-en"
    assert cli.default_out("translation", None, cli.inherited_direction(str(ROOT / "models" / "tserve-de-en"))) == \
        "models/tserve-de-en"
    args = parser.parse_args(["eval", "models/x", "--limit", "10"])
    assert args.func is cli.run_eval and args.limit == 10
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "vit", "--steps", "1", "--epochs", "2"])


def test_cli_rejects_unknown_dataset(tmp_path, capsys):
    assert cli.main(["train", "vit", "--dataset", "cifar", "--out", str(tmp_path / "x")]) == 2
    assert cli.main(["train", "lm", "--dataset", "cifar", "--out", str(tmp_path / "x")]) == 2
    assert "fashion-mnist" in capsys.readouterr().err


def test_batch_sets_the_examples_of_a_step_for_translation_and_vit(tmp_path):
    mt = translation.MTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1),
                              vocab_size=200, max_len=48, batch_tokens=400, epochs=1, loop=_loop(0))
    translation.train(RunOptions(out=tmp_path / "mt", device="cpu", steps=2, batch=123), pairs={"train": PAIRS},
                      config=mt)
    info = json.loads((tmp_path / "mt" / "training.json").read_text())
    assert info["hyperparameters"]["batch_tokens"] == 123
    assert info["data"]["batches_per_epoch"] == len(translation.make_batches(
        translation.encode_pairs(load(tmp_path / "mt").tokenizer, PAIRS, 48), 123, torch.Generator()))
    vt = vit.ViTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_layers=1, patch_size=7), batch_size=32,
                       epochs=1, loop=_loop(0), max_rotation=0, max_shift=0, scale=(1.0, 1.0))
    vit.train(RunOptions(out=tmp_path / "vit", device="cpu", dataset="mnist-digits", steps=2, batch=7),
              data={"train": _images(60, 0), "test": _images(8, 1)}, config=vt)
    assert json.loads((tmp_path / "vit" / "training.json").read_text())["hyperparameters"]["batch_size"] == 7


def test_vit_keeps_its_most_accurate_weights(tmp_path, monkeypatch):
    """A classifier's loss can rise while its accuracy still improves: the ViT trainer keeps by accuracy."""
    asked = {}

    def recording_loop(*args, **kwargs):
        asked.update(kwargs)
        return train_loop(*args, **kwargs)

    monkeypatch.setattr(vit, "train_loop", recording_loop)
    vt = vit.ViTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_layers=1, patch_size=7), batch_size=32,
                       epochs=1, loop=_loop(0), max_rotation=0, max_shift=0, scale=(1.0, 1.0))
    vit.train(RunOptions(out=tmp_path, device="cpu", dataset="mnist-digits", steps=2),
              data={"train": _images(60, 0), "test": _images(8, 1)}, config=vt)
    assert asked["best_metric"] == "val_accuracy" and asked["higher_is_better"] is True
    info = json.loads((tmp_path / "training.json").read_text())
    best = max(row["val_accuracy"] for row in info["validation"])
    assert next(r for r in info["validation"] if r["step"] == info["kept_step"])["val_accuracy"] == best


def test_dropout_reaches_every_layer_of_a_model_trained_without_it():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_seq_len=8)).train()
    ids = torch.randint(0, 50, (2, 8))
    eval_logits = model.eval()(ids)
    assert torch.equal(model.train()(ids), eval_logits)  # dropout 0: training mode changes nothing
    set_dropout(model, 0.5)
    assert model.cfg.dropout == 0.5 and not torch.allclose(model(ids), model(ids))
    assert all(m.p == 0.5 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(m.dropout == 0.5 for m in model.modules() if isinstance(m, Attention))
    assert torch.allclose(model.eval()(ids), eval_logits)  # inference is untouched
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["train", "lm", "--dropout", "0.1"]).dropout == 0.1
    for bad in ("1", "-0.1", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["train", "lm", "--dropout", bad])


def test_count_parameters_counts_tied_weights_once():
    model = Decoder(DecoderConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_seq_len=8))
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    assert count_parameters(model) < sum(p.numel() for p in model.state_dict().values())


def test_plan_loop_applies_the_command_line():
    from tserve.training.common import plan_loop
    from tserve.training.loop import LoopConfig

    loop = plan_loop(LoopConfig(lr=2e-3, warmup_steps=500, eval_every=1000), RunOptions(out=Path("x"), lr=1e-4,
                     epochs=2, max_minutes=3.0), None, 10.0, 640, 64)
    assert (loop.steps, loop.lr, loop.max_minutes, loop.warmup_steps, loop.eval_every) == (20, 1e-4, 3.0, 2, 20)
    loop = plan_loop(LoopConfig(lr=2e-3), RunOptions(out=Path("x")), 7, None, 640, 64)
    assert (loop.steps, loop.lr) == (7, 2e-3)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["train", "vit", "--lr", "3e-4"]).lr == 3e-4
    assert parser.parse_args(["train", "translation", "--batch", "12000"]).batch == 12000
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "lm", "--batch", "0"])


def test_eval_records_int8_figures_beside_the_float32_ones(tiny_vit, tmp_path, monkeypatch):
    """`tserve eval --quantize int8` evaluates the int8 model and stores its figures in metrics.json, under a
    key for the activations it ran with ("int8_split", "int8_7bit"; "int8" for 8-bit ones), so that the two
    CPU paths' figures stand side by side (the model card lists them); a float32 evaluation afterwards keeps
    them."""
    import shutil

    ckpt = tmp_path / "vit"
    shutil.copytree(tiny_vit, ckpt)
    seen = []

    def fake_evaluate(loaded, path, *, limit=None, data_root=None, full=True):  # noqa: ANN001, ANN202
        activations = {m.activations for m in loaded.model.modules() if hasattr(m, "activations")}
        seen.append((loaded.quantization, *activations))
        if loaded.quantization == "int4":
            return {"accuracy": 0.3}
        return {"accuracy": {"split": 0.5, "7bit": 0.4}[activations.pop()] if activations else 0.6}

    monkeypatch.setattr(evaluate, "evaluate_loaded", fake_evaluate)
    monkeypatch.setitem(evaluate.REFERENCE_SLICE, evaluate.task_of(evaluate.load(ckpt)), 5)
    for activations in ("split", "7bit"):
        assert cli.main(["eval", str(ckpt), "--quantize", "int8", "--int8-activations", activations]) == 0
    stored = json.loads((ckpt / "metrics.json").read_text())
    assert stored["int8_split"] == {"limit": None, "activations": "split", "accuracy": 0.5}
    assert stored["int8_7bit"]["accuracy"] == 0.4 and seen == [("int8", "split"), ("int8", "7bit")]
    assert cli.main(["eval", str(ckpt), "--quantize", "int4"]) == 0
    assert json.loads((ckpt / "metrics.json").read_text())["int4"] == {"limit": None, "group_size": 32,
                                                                       "accuracy": 0.3}
    assert cli.main(["eval", str(ckpt), "--quantize", "q4_0"]) == 0
    assert json.loads((ckpt / "metrics.json").read_text())["q4_0"]["group_size"] == 32 and seen[-1] == ("q4_0",)
    evaluate.evaluate_checkpoint(ckpt, device="cpu")
    stored = json.loads((ckpt / "metrics.json").read_text())
    assert stored["accuracy"] == 0.6 and stored["int8_split"]["accuracy"] == 0.5 and stored["int4"]["accuracy"] == 0.3
    card = (ckpt / "MODEL_CARD.md").read_text()
    assert "| int8_split.accuracy | 0.5 |" in card and "| int4.accuracy | 0.3 |" in card and "`int4.*`" in card
