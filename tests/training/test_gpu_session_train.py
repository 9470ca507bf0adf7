"""The GPU machine's train step (`bench/gpu_session.sh pack`, then `train`), run here on the CPU for a moment
on a tiny data set: the pack travels, the three text models continue from their committed weights side by
side, and what comes back is one float16 weights file each plus their records: checked here, so that a step
does not first break on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch
from safetensors import safe_open

from tserve.testing.corpus import DE, EN
from tserve.training.data.sources import (
    LM_CHUNK_CHARS,
    LM_TEST_FRAC,
    LM_VALID_FRAC,
    PROCESSING_VERSION,
    TRANSLATION_TEST_FRAC,
    TRANSLATION_VALID_FRAC,
)

ROOT = Path(__file__).resolve().parents[2]


def write_tiny_processed_data(processed: Path) -> None:
    processed.mkdir(parents=True)
    pairs = "".join(json.dumps({"en": en, "de": de, "source": "ding"}) + "\n" for en, de in zip(EN, DE, strict=True))
    text = " ".join(EN * 20)
    chunks = "".join(json.dumps({"id": f"tiny#{i}", "text": text}) + "\n" for i in range(4))
    mt = f"translation-v{PROCESSING_VERSION}-{TRANSLATION_VALID_FRAC:g}-{TRANSLATION_TEST_FRAC:g}"
    lm = f"lm-v{PROCESSING_VERSION}-{LM_VALID_FRAC:g}-{LM_TEST_FRAC:g}-{LM_CHUNK_CHARS}"
    for split in ("train", "valid", "test"):
        (processed / f"{mt}-{split}.jsonl").write_text(pairs)
        (processed / f"{lm}-{split}.jsonl").write_text(chunks)


def test_the_gpu_train_step_continues_the_bundled_text_models_from_a_data_pack(tmp_path):
    write_tiny_processed_data(tmp_path / "data" / "processed")
    out = tmp_path / "out"
    env = {**os.environ, "TSERVE_DATA_DIR": str(tmp_path / "data"), "PACK": str(tmp_path / "pack" / "data.tar.xz"),
           "TRAIN_RUNS": str(tmp_path / "runs"), "OUT": str(out), "TRAIN_DEVICE": "cpu", "TRAIN_MINUTES": "0.001",
           "NO_WHEELS": "1", "MT_BATCH": "200", "LM_BATCH": "2", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for step in ("pack", "train"):
        done = subprocess.run(["bash", "bench/gpu_session.sh", step], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("en-de", "de-en", "lm"):
        with safe_open(str(out / f"{name}.safetensors"), "pt") as f:
            dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        assert dtypes == {torch.float16}, name
    with tarfile.open(out / "train-records.tar.gz") as records:
        names = set(records.getnames())
        assert not any(n.endswith(".safetensors") for n in names) and "./data" not in names
        for name in ("en-de", "de-en", "lm"):
            info = json.load(records.extractfile(f"./{name}/training.json"))
            assert info["continued_from"]["path"] == f"models/tserve-{name}"
            assert info["kept_step"] in {row["step"] for row in info["validation"]}
            assert "--dropout 0.1" in info["command"] and "--device cpu" in info["command"]
        config = json.load(records.extractfile("./lm/config.json"))
    assert config["dropout"] == 0.1
