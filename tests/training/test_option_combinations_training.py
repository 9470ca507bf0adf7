"""Training and evaluation where their options meet: each model kind continued from committed weights with a
dropout of its own, a translator trained German → English and validated that way, `eval --quantize q8_0` and `int4`
beside the float32 figures (and the model card that shows them), `top1_agreement` and perplexity on a
`--limit`ed test split, autocast switched off, and `half` storage with its card. All on
CPU in seconds, with tiny models and a tiny processed data set (no downloads)."""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.helpers.fixture_training import CYCLE_TEXT
from tests.training.test_train import PAIRS, _images, _loop
from tserve.model.checkpoint import load
from tserve.testing.corpus import DE, EN
from tserve.training import cli, evaluate, lm, translation, vit
from tserve.training.common import RunOptions
from tserve.training.data.sources import LM_CHUNK_CHARS, LM_TEST_FRAC, LM_VALID_FRAC, PROCESSING_VERSION
from tserve.training.loop import autocast_context


# --------------------------------------------------------------------------------------------------
# Continued training, for every model kind
# --------------------------------------------------------------------------------------------------
def _train_tiny(kind: str, out, **options):  # noqa: ANN001, ANN202
    """One or two steps of `kind`'s trainer on inline data, with `options` as the command line gives them."""
    opts = RunOptions(out=out, device="cpu", command=f"train {kind}", **options)
    if kind == "lm":
        texts = [" ".join(EN * 4), " ".join(reversed(EN)) * 3]
        cfg = lm.LMPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_layers=1), vocab_size=300, context=16,
                          batch_size=4, steps=1, loop=_loop(0), val_windows=4)
        return lm.train(opts, corpus={"train": texts, "valid": texts[:1]}, config=cfg)
    if kind == "translation":
        cfg = translation.MTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1,
                                              n_decoder_layers=1), vocab_size=200, max_len=48, batch_tokens=400,
                                   epochs=1, loop=_loop(0))
        return translation.train(opts, pairs={"train": PAIRS, "valid": PAIRS[:3]}, config=cfg)
    cfg = vit.ViTPreset(model=dict(d_model=32, n_heads=4, d_ff=64, n_layers=1, patch_size=7), batch_size=16,
                        epochs=1, loop=_loop(0), max_rotation=0, max_shift=0, scale=(1.0, 1.0))
    return vit.train(RunOptions(**{**opts.__dict__, "dataset": "mnist-digits"}),
                     data={"train": _images(60, 0), "test": _images(8, 1)}, config=cfg)


@pytest.mark.parametrize("kind", ["lm", "translation", "vit"])
def test_every_model_kind_continued_with_a_new_dropout_validates_its_start_and_records_the_run(kind, tmp_path):
    """`train --init-from DIR --dropout P` means the same for every trainer: the starting weights are validated
    (step 0) and kept unless a later validation beats them, the new dropout reaches the saved config, and the
    run's record and card name the run it continued."""
    first = _train_tiny(kind, tmp_path / "first", steps=1)
    assert json.loads((first / "config.json").read_text())["dropout"] == 0.0
    again = _train_tiny(kind, tmp_path / "again", steps=2, init_from=str(first), dropout=0.25)
    info = json.loads((again / "training.json").read_text())
    assert [row["step"] for row in info["validation"]] == [0, 2]
    assert info["kept_step"] in (0, 2)
    assert info["continued_from"]["path"] == str(first) and info["continued_from"]["command"] == f"train {kind}"
    assert json.loads((again / "config.json").read_text())["dropout"] == 0.25
    assert "continued from 1 earlier run" in (again / "MODEL_CARD.md").read_text()


@pytest.mark.parametrize("kind", ["lm", "vit"])
def test_weights_trained_into_a_directory_with_test_figures_leave_them_behind(kind, tmp_path):
    """Retraining into the directory of an evaluated model (`--out` as before, e.g. the default) writes new weights:
    the test figures stored there were the old weights', so they go, and the new card shows none of them."""
    out = tmp_path / kind
    _train_tiny(kind, out, steps=1)
    (out / "metrics.json").write_text(json.dumps({"accuracy": 0.987, "perplexity": 12.34}))
    _train_tiny(kind, out, steps=1, seed=5)
    card = (out / "MODEL_CARD.md").read_text()
    assert not (out / "metrics.json").exists() and "0.987" not in card and "12.34" not in card


def test_a_german_to_english_translator_is_validated_and_continued_german_to_english(tmp_path):
    """The validation loss that picks the kept weights is measured in the direction the model is trained in, and
    a run continued from it inherits that direction."""
    out = _train_tiny("translation", tmp_path / "de-en", steps=2, direction="de-en")
    info = json.loads((out / "training.json").read_text())
    assert info["direction"] == "de-en" and info["kept_step"] == 2
    loaded = load(out)
    assert loaded.languages == ("de", "en")
    tok = loaded.tokenizer
    expected = translation.mean_nll(loaded.model, translation.encode_pairs(tok, PAIRS[:3], 48, ("de", "en")),
                                    tok.pad_id, tok.bos_id)
    other_way = translation.mean_nll(loaded.model, translation.encode_pairs(tok, PAIRS[:3], 48, ("en", "de")),
                                     tok.pad_id, tok.bos_id)
    assert abs(expected - other_way) > 1e-3  # the two directions are told apart
    assert info["validation"][-1]["val_loss"] == pytest.approx(expected, abs=1e-4)
    # Continued without --direction, it goes on translating (and being validated) German → English.
    again = _train_tiny("translation", tmp_path / "again", steps=1, init_from=str(out))
    assert json.loads((again / "training.json").read_text())["direction"] == "de-en"
    assert load(again).languages == ("de", "en")


# --------------------------------------------------------------------------------------------------
# Evaluation of a language model: quantized formats, --limit, agreement, perplexity, the card
# --------------------------------------------------------------------------------------------------
LM_TEST_TEXTS = [CYCLE_TEXT * 2, CYCLE_TEXT[40:] * 2, " ".join(EN * 3), " ".join(DE * 3)]


def _write_lm_data(root) -> None:  # noqa: ANN001
    """A processed LM corpus under `root` (as `load_lm_corpus` caches it), its test texts distinct."""
    processed = root / "processed"
    processed.mkdir(parents=True)
    tag = f"lm-v{PROCESSING_VERSION}-{LM_VALID_FRAC:g}-{LM_TEST_FRAC:g}-{LM_CHUNK_CHARS}"
    words = CYCLE_TEXT.split()
    random.Random(0).shuffle(words)
    splits = {"train": [CYCLE_TEXT * 3, " ".join(words)], "valid": [" ".join(EN)], "test": LM_TEST_TEXTS}
    for split, texts in splits.items():
        (processed / f"{tag}-{split}.jsonl").write_text(
            "".join(json.dumps({"id": f"tiny#{i}", "text": t}) + "\n" for i, t in enumerate(texts)))


@pytest.fixture
def lm_checkpoint(tiny_lm, tmp_path):  # noqa: ANN001, ANN201
    ckpt = shutil.copytree(tiny_lm, tmp_path / "lm")
    _write_lm_data(tmp_path / "data")
    return ckpt, str(tmp_path / "data")


def test_quantized_lm_figures_on_a_limited_split_are_those_of_the_same_texts(lm_checkpoint, monkeypatch):
    """With `--quantize int4 --limit 2`, the perplexity and the top-1 agreement with float32 are both those of the
    first two test texts, every scored token counted once, and the agreement is against the float32 weights."""
    ckpt, data_root = lm_checkpoint
    agreement_streams = []  # the token streams the agreement is measured on
    measure = lm.strided_top1_agreement
    monkeypatch.setattr(lm, "strided_top1_agreement",
                        lambda ref, q, stream, *rest: (agreement_streams.append(len(stream)), measure(ref, q, stream,
                                                                                                   *rest))[1])
    figures = evaluate.evaluate_checkpoint(ckpt, limit=2, device="cpu", data_root=data_root, quantize="int4",
                                           write=False)
    monkeypatch.undo()
    reference, quantized = load(ckpt, device="cpu"), load(ckpt, device="cpu", quantize="int4")
    context = reference.model.cfg.max_seq_len
    stream = lm.token_stream(reference.tokenizer, LM_TEST_TEXTS[:2])
    agreement, positions = lm.strided_top1_agreement(reference.model, quantized.model, stream, context,
                                                     context // 2)
    nll, count = lm.strided_nll(quantized.model, stream, context, context // 2)
    assert count == positions == len(stream) - 1  # each token after the first is scored once, no padding
    assert figures["test_tokens"] == count and figures["limit"] == 2 and figures["group_size"] == 32
    assert figures["perplexity"] == pytest.approx(round(math.exp(nll), 2))
    assert figures["top1_agreement"] == pytest.approx(round(agreement, 4))
    assert agreement < 1.0  # int4 changes some next tokens: a float32 reference tells
    assert agreement_streams == [len(stream)] < [len(lm.token_stream(reference.tokenizer, LM_TEST_TEXTS))]


def test_each_quantized_format_is_stored_under_its_own_key_and_survives_a_float32_evaluation(lm_checkpoint):
    """`eval --quantize q8_0`, then `int4`: each format's figures under its own name, the card re-rendered with
    them as each is stored; a float32 evaluation afterwards keeps every one of them."""
    ckpt, data_root = lm_checkpoint
    assert cli.main(["eval", str(ckpt), "--quantize", "q8_0", "--limit", "2", "--device", "cpu",
                     "--data-dir", data_root]) == 0
    stored = json.loads((ckpt / "metrics.json").read_text())
    assert set(stored) == {"q8_0"} and stored["q8_0"]["group_size"] == 32
    card = (ckpt / "MODEL_CARD.md").read_text()
    assert f"| q8_0.top1_agreement | {stored['q8_0']['top1_agreement']:.4g} |" in card
    assert "`q8_0.*` / `q4_0.*`: the same evaluation with `--quantize q8_0` / `q4_0`" in card  # what the figures are
    assert cli.main(["eval", str(ckpt), "--quantize", "int4", "--limit", "2", "--device", "cpu",
                     "--data-dir", data_root]) == 0
    stored = json.loads((ckpt / "metrics.json").read_text())
    assert set(stored) == {"q8_0", "int4"}
    assert f"| int4.perplexity | {stored['int4']['perplexity']:.4g} |" in (ckpt / "MODEL_CARD.md").read_text()
    float32 = evaluate.evaluate_checkpoint(ckpt, limit=2, device="cpu", data_root=data_root)
    stored = json.loads((ckpt / "metrics.json").read_text())
    assert stored["perplexity"] == float32["perplexity"] and stored["limit"] == 2
    assert {"q8_0", "int4"} <= set(stored)
    card = (ckpt / "MODEL_CARD.md").read_text()
    assert "| q8_0.perplexity |" in card and "| int4.perplexity |" in card


# --------------------------------------------------------------------------------------------------
# Autocast and float16 storage
# --------------------------------------------------------------------------------------------------
def test_autocast_is_off_when_the_loop_turns_it_off_even_on_cuda():
    """`LoopConfig(amp=False)` trains in float32 on a GPU too: no autocast context and no gradient scaler."""
    for device in (torch.device("cuda"), torch.device("cpu")):
        ctx, scaler = autocast_context(device, enabled=False)
        assert isinstance(ctx, contextlib.nullcontext) and scaler is False
    ctx, scaler = autocast_context(torch.device("cpu"), enabled=True)
    assert isinstance(ctx, contextlib.nullcontext) and scaler is False


def test_half_stores_float16_keeps_the_metadata_and_rerenders_the_card(tmp_path):
    """`python -m tserve.training half DIR`: every float32 tensor stored as float16, the file's metadata kept, the
    model loads and serves as before (within float16 rounding), and the card names the stored dtype."""
    out = _train_tiny("vit", tmp_path / "vit", steps=1)
    assert "(float32)" in (out / "MODEL_CARD.md").read_text()
    before = load(out)
    assert cli.main(["half", str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "producer": "tserve"}
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118
    card = (out / "MODEL_CARD.md").read_text()
    assert "(float16)" in card and "(float32)" not in card
    after = load(out)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(after.model(x), before.model(x), atol=5e-2)
