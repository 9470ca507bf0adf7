"""Where the CPU decode paths' formats and options meet: a served language model and its --draft-model take every
quantization option the settings give (--quantize, --int4-group-size, --int8-activations, --dtype, --fused-layers),
not only the defaults; and Q8_0 / Q4_0 layers held on PyTorch's statement of the block maths (the kernels held below
AVX2) keep their decode steps right under --fused-layers, where a float32 model's steps do not fuse at all (the
fused step has no path below AVX2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.test_fused_decode import PROMPTS, served, steps
from tserve.model.block_quant import BlockLinear
from tserve.model.fused_decode import FusedDecode
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.quantize import Int4Linear, Int8Linear
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.settings import Settings

# Each path depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"


def _started(**settings) -> ModelRegistry:  # noqa: ANN003 - Settings fields
    reg = ModelRegistry(Settings(models=[f"lm={TINY_LM}"], device="cpu", draft_model=str(TINY_LM), warmup=False,
                                 gc_freeze=False, **settings), Metrics())
    reg.start_loading()
    reg.wait_loaded(120)
    assert reg.ready, reg.error
    return reg


def _served_and_draft(reg: ModelRegistry):  # noqa: ANN202 - (LoadedModel, LoadedModel)
    served_model = reg.models["lm"]
    assert served_model.draft is not None, "--draft-model given, yet the model drafts without one"
    return served_model.loaded, served_model.draft


def test_an_int4_group_size_reaches_the_served_model_and_its_draft():
    """--int4-group-size 64: every int4 layer of the model and of the draft model loaded beside it groups 64
    weights per scale, not the default 32 (the draft is "loaded as the models it drafts for are")."""
    reg = _started(quantize="int4", int4_group_size=64)
    try:
        for loaded in _served_and_draft(reg):
            sizes = {m.group_size for m in loaded.model.modules() if isinstance(m, Int4Linear)}
            assert sizes == {64}, (loaded.path, sizes)
            assert loaded.quantization == "int4"
    finally:
        reg.stop()


def test_int8_activations_reach_the_served_model_and_its_draft():
    """--int8-activations 7bit (taken on every CPU): every int8 layer of the model and of its draft model
    quantizes its inputs on 7 bits, not the `auto` choice."""
    reg = _started(quantize="int8", int8_activations="7bit")
    try:
        for loaded in _served_and_draft(reg):
            layers = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
            assert layers and {m.activations for m in layers} == {"7bit"}, (loaded.path, layers[:1])
    finally:
        reg.stop()


def test_a_bfloat16_model_drafts_with_a_bfloat16_draft():
    """--dtype bfloat16: the draft model is held in the served model's dtype too (half its float32 bytes, which
    --max-model-memory counts as such)."""
    reg = _started(dtype="bfloat16")
    try:
        for loaded in _served_and_draft(reg):
            assert loaded.dtype == torch.bfloat16, loaded.path
    finally:
        reg.stop()


def test_fused_layers_fuse_the_draft_models_steps_as_the_served_models():
    """--fused-layers with --quantize q8_0: the draft model's one-token steps (k - 1 of them each speculative
    step) run in one C++ call as the served model's do, on the same Q8_0 layers."""
    if cpu_kernels.extension() is None:
        pytest.skip("no fused decode step without the CPU kernels")
    reg = _started(quantize="q8_0", fused_layers=True)
    try:
        for loaded in _served_and_draft(reg):
            assert loaded.quantization == "q8_0"
            assert loaded.model.fused is not None, f"{loaded.path}: decode steps not fused"
    finally:
        reg.stop()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_block_layers_on_pytorchs_statement_keep_their_steps_under_fused_layers(monkeypatch, fmt):
    """PyTorch held below AVX2 (ATEN_CPU_CAPABILITY=default): the block layers hold their plain codes for
    PyTorch's statement of the maths, not the kernels' panels. Asked to fuse, such a model's decode steps give
    what its layers give, step after step (the fused step, if it runs at all, must not read plain codes as
    panels)."""
    if cpu_kernels.extension() is None:
        pytest.skip("the fused step needs the CPU kernels")
    cpu_kernels.kernel_isa.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    try:
        model = served("llama", fmt)
        blocks = [m for m in model.modules() if isinstance(m, BlockLinear)]
        assert blocks and all(m.isa is None for m in blocks)
        layered = steps(model, None, PROMPTS, 4)
        asked = steps(model, FusedDecode.build(model), PROMPTS, 4)
    finally:
        cpu_kernels.kernel_isa.cache_clear()
    for step, (a, b) in enumerate(zip(layered, asked, strict=True)):
        assert torch.equal(b.argmax(-1), a.argmax(-1)), f"step {step}: another greedy token"
        assert (b - a).abs().max() < 0.15, f"step {step}"


def test_a_float32_model_does_not_fuse_where_the_kernels_have_no_path(monkeypatch):
    """PyTorch held below AVX2 (or kernels not compiled for this CPU): the fused step's products and attention
    have no path to run on, so a float32 model asked to fuse keeps its layer-by-layer steps instead of running
    the AVX2 path anyway."""
    if cpu_kernels.extension() is None:
        pytest.skip("the fused step needs the CPU kernels")
    model = served("llama", "float32")
    assert FusedDecode.build(model) is not None  # where the kernels run, it fuses
    cpu_kernels.kernel_isa.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    try:
        assert FusedDecode.build(model) is None
    finally:
        cpu_kernels.kernel_isa.cache_clear()
