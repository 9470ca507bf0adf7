"""Our checkpoint format: round trip, detection, clear errors, no pickle."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from tserve.model.checkpoint import (
    CheckpointError,
    cpu_bfloat16_native,
    emulated_bfloat16_note,
    load,
    resolve_device,
    resolve_dtype,
    save_checkpoint,
)
from tserve.model.uninitialized import uninitialized_weights


def test_round_trip_each_architecture(tiny_lm, tiny_mt, tiny_vit, tmp_path):
    for path, task in ((tiny_lm, "text-generation"), (tiny_mt, "translation"), (tiny_vit, "image-classification")):
        first = load(path)
        assert first.task == task and first.source_format == "tserve"
        again = load(save_checkpoint(tmp_path / task, first.model, tokenizer=first.tokenizer, labels=first.labels,
                                     preprocessing=first.preprocessing, generation=first.generation))
        for (k, a), (k2, b) in zip(first.model.state_dict().items(), again.model.state_dict().items(), strict=True):
            assert k == k2 and torch.equal(a, b)
        assert again.generation == first.generation and again.labels == first.labels
    mt = load(tiny_mt)
    assert mt.generation.num_beams == 2 and mt.tokenizer.encode("Hello")[-1] == mt.tokenizer.eos_id
    vit = load(tiny_vit)
    assert vit.labels == ["circle", "square", "line", "dot"] and vit.preprocessing.invert == "auto"


def test_tied_weights_stay_tied_after_load(tiny_lm):
    m = load(tiny_lm).model
    assert m.lm_head.weight.data_ptr() == m.tok_emb.weight.data_ptr()


def test_bfloat16_on_kernels_held_to_avx2_loads_with_a_note_that_it_is_emulated(tiny_lm):
    """What an AVX2-only CPU gets, on any CPU: PyTorch's kernels held to AVX2 compute no bfloat16 natively; the
    model loads in bfloat16 all the same, and the log says so."""
    import os
    import subprocess
    import sys

    code = ("import logging, sys; from tserve.model.checkpoint import cpu_bfloat16_native, load; "
            "logging.basicConfig(stream=sys.stdout, level=logging.WARNING); "
            f"print(cpu_bfloat16_native(), load({str(tiny_lm)!r}, dtype='bfloat16').dtype)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert "bfloat16 on this CPU is emulated" in out.stdout and "AVX2" in out.stdout
    assert out.stdout.strip().endswith("False torch.bfloat16")
    assert emulated_bfloat16_note(torch.float32, torch.device("cpu")) is None


def test_bfloat16_is_native_where_the_cpu_has_its_instructions_and_pytorch_may_use_them():
    """AVX512-BF16 or AMX in /proc/cpuinfo, PyTorch's kernels not held below AVX-512: native, and no note; otherwise
    (an AVX2-only CPU, or `make test-avx2`'s process) emulated, and the note says so."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or not Path("/proc/cpuinfo").exists():
        pytest.skip("the flags are x86's, read from /proc/cpuinfo")
    flags = set(Path("/proc/cpuinfo").read_text().split())
    native = bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert cpu_bfloat16_native() == native
    assert (emulated_bfloat16_note(torch.bfloat16, torch.device("cpu")) is None) == native


def test_dtype_and_device_resolution(tiny_lm):
    assert load(tiny_lm, dtype="bfloat16").dtype == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(d, edit):
    (d / "config.json").write_text(json.dumps(edit(json.loads((d / "config.json").read_text()))))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "config.json").unlink(), "config.json: missing"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
        (lambda d: (d / "config.json").write_text('{"foo": 1}'), "neither a tserve config"),
        (lambda d: (d / "config.json").write_text('{"model_type": "bert"}'), "model_type 'bert' is not supported"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "model.safetensors: corrupt"),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer"),
        # A width other than the weights' (whatever the fixture's is).
        (lambda d: _edit_config(d, lambda c: {**c, "d_model": 2 * c["d_model"]}), "weights do not match|shape"),
        (lambda d: _edit_config(d, lambda c: {**c, "n_headz": 2}), "unknown decoder config fields"),
        (lambda d: _edit_config(d, lambda c: {**c, "task": ["text-generation"]}), "'task' must be a string"),
    ],
)
def test_bad_checkpoints_name_the_file(tiny_lm, tmp_path, damage, message):
    d = _copy(tiny_lm, tmp_path / "ckpt")
    damage(d)
    with pytest.raises(CheckpointError, match=message):
        load(d)


def test_pickled_hf_weights_are_refused(hf_gpt2, tmp_path):
    d = _copy(hf_gpt2, tmp_path / "gpt2")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickled weights are not loaded"):
        load(d)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load(tmp_path / "nope")


def test_a_translators_languages(tiny_mt, hf_marian, tmp_path):
    assert load(tiny_mt).languages is None  # nothing names them
    ours = load(save_checkpoint(tmp_path / "ours", load(tiny_mt).model, tokenizer=load(tiny_mt).tokenizer,
                                languages=("de", "en")))
    assert ours.languages == ("de", "en")
    # Hugging Face Marian: tokenizer_config.json's source_lang / target_lang, else an opus-mt-xx-yy name.
    assert load(hf_marian).languages == ("en", "de")

    def unnamed(d):
        config = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                             if k not in ("source_lang", "target_lang")}))
        return d

    named = unnamed(_copy(hf_marian, tmp_path / "opus-mt-nl-fr"))
    assert load(named).languages == ("nl", "fr")
    assert load(unnamed(_copy(hf_marian, tmp_path / "marian"))).languages is None
    config = json.loads((named / "tokenizer_config.json").read_text())
    (named / "tokenizer_config.json").write_text(json.dumps(config | {"source_lang": "es", "target_lang": "pt-BR"}))
    assert load(named).languages == ("es", "pt-BR")
    bad = _copy(tiny_mt, tmp_path / "bad")
    _edit_config(bad, lambda c: c | {"source_lang": "English!", "target_lang": "de"})
    with pytest.raises(CheckpointError, match="source_lang and target_lang must both be language codes"):
        load(bad)


def test_loading_draws_no_random_weights_and_leaves_other_threads_and_later_layers_their_own(tiny_lm, tiny_mt):
    """The weights a checkpoint fills are not drawn at random first (the generator does not move while two text
    models load); a layer built after loading, or on another thread meanwhile, is initialized as ever."""
    def seeded_linear() -> torch.Tensor:
        torch.manual_seed(7)
        return torch.nn.Linear(32, 32).weight.detach().clone()

    expected = seeded_linear()
    state = torch.random.get_rng_state()
    lm, mt = load(tiny_lm), load(tiny_mt)
    assert torch.equal(torch.random.get_rng_state(), state)  # nothing drawn
    assert lm.model.tok_emb.weight.abs().sum() > 0 and mt.model.lm_head.weight.abs().sum() > 0
    assert torch.equal(seeded_linear(), expected)  # this thread initializes again after loading
    built = {}
    with uninitialized_weights():
        other = threading.Thread(target=lambda: built.setdefault("weight", seeded_linear()))
        other.start()
        other.join()
        state = torch.random.get_rng_state()
        torch.nn.Linear(32, 32)
        assert torch.equal(torch.random.get_rng_state(), state)  # this thread, inside: nothing drawn
    assert torch.equal(built["weight"], expected)  # the other thread, meanwhile: its own seeded weights
