"""Taking in a GPU lease's weights (`python -m tserve.training.adopt`): a candidate no better than the bundled model
leaves every file as it was; a better one is installed with its run's records, its figures and a card that names
the GPU. On a tiny data set, with the bundled weights as the candidates."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.training.test_gpu_session_train import write_tiny_processed_data
from tserve.training.adopt import is_better, main

ROOT = Path(__file__).resolve().parents[2]
GPU = "NVIDIA H200 (CUDA 13.0), torch 2.11.0+cu130"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("data")
    write_tiny_processed_data(root / "processed")
    return str(root)


def _returned(tmp: Path, names: tuple[str, ...]) -> Path:
    """What a lease brings back: the weights files and results.tar.gz holding the trainings' records."""
    out = tmp / "returned"
    out.mkdir()
    records = io.BytesIO()
    with tarfile.open(fileobj=records, mode="w:gz") as tar:
        for name in names:
            bundled = ROOT / "models" / f"tserve-{name}"
            shutil.copyfile(bundled / "model.safetensors", out / f"{name}.safetensors")
            info = json.loads((bundled / "training.json").read_text()) | {"hardware": GPU}
            for file, body in (("training.json", json.dumps(info).encode()),
                               ("config.json", (bundled / "config.json").read_bytes())):
                member = tarfile.TarInfo(f"./{name}/{file}")
                member.size = len(body)
                tar.addfile(member, io.BytesIO(body))
    with tarfile.open(out / "results.tar.gz", "w:gz") as results:
        member = tarfile.TarInfo("./train-records.tar.gz")
        member.size = len(records.getvalue())
        results.addfile(member, io.BytesIO(records.getvalue()))
    return out


def _models(tmp: Path, name: str) -> Path:
    models = tmp / "models"
    shutil.copytree(ROOT / "models" / f"tserve-{name}", models / f"tserve-{name}")
    return models


def test_a_candidate_no_better_than_the_bundled_model_changes_nothing(tmp_path, data_dir, capsys):
    models = _models(tmp_path, "en-de")
    before = {p.name: p.read_bytes() for p in (models / "tserve-en-de").iterdir()}
    assert main([str(_returned(tmp_path, ("en-de",))), "--models", str(models), "--data-dir", data_dir,
                 "--limit", "3"]) == 0
    assert {p.name: p.read_bytes() for p in (models / "tserve-en-de").iterdir()} == before
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| tserve-en-de |") and row.endswith("| False | False |") and GPU in row


@pytest.mark.slow  # 8 s: the candidate's perplexity on the whole test split
def test_a_better_candidate_is_installed_with_its_records_and_a_card_naming_the_gpu(tmp_path, data_dir):
    models = _models(tmp_path, "lm")
    bundled = models / "tserve-lm"
    weights = load_file(bundled / "model.safetensors")
    torch.manual_seed(0)  # the bundled model made worse: the committed weights are the better candidate
    save_file({k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()},
              bundled / "model.safetensors")
    returned = _returned(tmp_path, ("lm",))
    assert main([str(returned), "--models", str(models), "--data-dir", data_dir]) == 0
    assert (bundled / "model.safetensors").read_bytes() == (returned / "lm.safetensors").read_bytes()
    assert json.loads((bundled / "training.json").read_text())["hardware"] == GPU
    metrics = json.loads((bundled / "metrics.json").read_text())
    assert metrics["limit"] is None and metrics["perplexity"] > 1  # the candidate's own figures, whole split
    card = (bundled / "MODEL_CARD.md").read_text()
    assert f"Trained on {GPU}; installed on" in card
    assert f"→ {metrics['perplexity']}" in card  # the note: the bundled figure, then the candidate's


def test_better_is_higher_bleu_without_losing_everyday_chrf_or_a_lower_perplexity():
    assert is_better({"bleu": 31.0, "ding_chrf": 32.0}, {"bleu": 30.9, "ding_chrf": 32.0})
    assert not is_better({"bleu": 31.0, "ding_chrf": 31.9}, {"bleu": 30.9, "ding_chrf": 32.0})
    assert not is_better({"bleu": 30.9, "ding_chrf": 40.0}, {"bleu": 30.9, "ding_chrf": 32.0})
    assert is_better({"perplexity": 29.0}, {"perplexity": 29.9})
    assert not is_better({"perplexity": 29.9}, {"perplexity": 29.9})
