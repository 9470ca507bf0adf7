"""`quantize="int8"` (`--quantize int8`): every linear layer of each model kind holds int8 weights, a quarter
of the float32 bytes, and the outputs move only within stated bounds: logits of the tiny models, and on
fixed slices of the bundled models' test splits chrF, identical translations, perplexity and accuracy."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tserve.model.checkpoint import load
from tserve.model.quantize import (
    Int8Linear,
    is_int8_linear,
    linear_weight_bytes,
    quantize_int4,
    quantize_int8,
    resolve_activations,
)
from tserve.testing.avx2_only import AVX2_ONLY
from tserve.training import data as data_mod

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

ROOT = Path(__file__).resolve().parents[2]


def _logits(loaded, which: str) -> torch.Tensor:  # noqa: ANN001
    torch.manual_seed(0)
    with torch.inference_mode():
        if which == "lm":
            return loaded.model(torch.tensor([loaded.tokenizer.encode("Hello world, good morning to you")]))
        if which == "mt":
            src = torch.tensor([loaded.tokenizer.encode("Good morning, my friend.")])
            dec = torch.tensor([[loaded.config.decoder_start_token_id, 5, 6, 7]])
            return loaded.model(src, torch.tensor([src.size(1)]), dec)
        cfg = loaded.config
        return loaded.model(torch.rand(2, cfg.n_channels, cfg.image_size, cfg.image_size))


@pytest.mark.parametrize("which", ["lm", "mt", "vit"])
def test_every_linear_layer_holds_int8_weights_and_logits_stay_close(which, tiny_lm, tiny_mt, tiny_vit):
    path = {"lm": tiny_lm, "mt": tiny_mt, "vit": tiny_vit}[which]
    fp32, int8 = load(path), load(path, quantize="int8")
    assert int8.quantization == "int8" and fp32.quantization == "none"
    float_linears = sum(isinstance(m, nn.Linear) for m in fp32.model.modules())
    assert not any(isinstance(m, nn.Linear) for m in int8.model.modules())  # none left in float
    assert sum(is_int8_linear(m) for m in int8.model.modules()) == float_linears > 0
    assert linear_weight_bytes(int8.model) == pytest.approx(linear_weight_bytes(fp32.model) / 4)
    ref, got = _logits(fp32, which), _logits(int8, which)
    assert not torch.equal(ref, got)  # the int8 path really ran
    # Bound: the largest difference stays under 5% of the logits' range.
    assert (got - ref).abs().max() < 0.05 * (ref.max() - ref.min())


def _long_tailed_rows() -> torch.Tensor:
    torch.manual_seed(0)
    rows = torch.randn(5, 64)
    rows[1] *= 1e-3
    rows[3, 7] = 1000.0
    rows[4] = 2.5  # a constant row
    return rows


def _relative_errors(layer: nn.Module, linear: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return (layer(rows) - linear(rows)).norm(dim=1) / (linear(rows) - linear.bias).norm(dim=1)


# The largest relative error of a row: 8-bit activations, 14-bit ones (split), where the int8 weights' own
# rounding (about 0.5%) is most of it, 7-bit ones, and 8-bit ones with 7-bit weights. Measured: 1.4%, 0.50%,
# 1.8% and 1.5%.
ROW_ERROR = {"full": 0.02, "split": 0.006, "7bit": 0.035, "7bit-weights": 0.02}


@pytest.mark.parametrize("activations", ["full", "split", "7bit", "7bit-weights"])
def test_an_int8_row_is_the_same_alone_and_beside_a_long_tailed_row(activations):
    """Activations are quantized per row: a small row next to one with a 1000x outlier keeps its own steps
    (one scale per batch would flatten it to a few levels), and every row equals itself computed alone.
    (`full` runs on our exact kernel where PyTorch's would overflow: tests/model/test_int8_gemm.py.)"""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = Int8Linear(linear, activations)
    rows = _long_tailed_rows()
    with torch.inference_mode():
        batch = layer(rows)
        for i in range(len(rows)):
            assert torch.equal(layer(rows[i : i + 1]), batch[i : i + 1])
        # 3-D input (batch, time, features) flattens to rows alike
        assert torch.equal(layer(rows.view(1, 5, 64)), batch.view(1, 5, 48))
    error = _relative_errors(layer, linear, rows)
    assert error.max() < ROW_ERROR[activations], error


class _WithOutputLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.lm_head = nn.Linear(64, 64), nn.Linear(64, 3000)


def _sums_in_int32_natively() -> bool:
    """This CPU has VNNI or AMX and the process is not held to AVX2 (`make test-avx2`)."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == AVX2_ONLY["ONEDNN_MAX_CPU_ISA"]
    return not held and bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def test_the_output_layer_takes_onednn_where_it_sums_in_int32_and_each_row_stays_its_own():
    """The output (vocabulary) layer runs on oneDNN's int8 GEMM where that sums 8-bit activations in int32 (VNNI,
    AMX; 1.4-2x fbgemm at NLLB's 256k outputs from 16 rows up), the other layers on the default engine; on either,
    every row equals itself computed alone and stays within `full`'s error."""
    torch.manual_seed(0)
    model = quantize_int8(_WithOutputLayer(), "full")
    assert model.body.engine is None
    expected = "onednn" if _sums_in_int32_natively() and not model.lm_head.exact else None
    assert model.lm_head.engine == expected
    int4 = quantize_int4(_WithOutputLayer())  # its output layer is int8 with `auto` activations, on that engine too
    assert int4.lm_head.activations == resolve_activations("auto")
    full = int4.lm_head.activations == "full" and not int4.lm_head.exact
    assert int4.lm_head.engine == ("onednn" if _sums_in_int32_natively() and full else None)
    rows = _long_tailed_rows()
    linear = nn.Linear(64, 3000)
    layer = Int8Linear(linear, "full", engine=expected)
    with torch.inference_mode():
        batch = layer(rows)
        for i in range(len(rows)):
            assert torch.equal(layer(rows[i : i + 1]), batch[i : i + 1])
    error = _relative_errors(layer, linear, rows)
    assert error.max() < ROW_ERROR["full"], error


def test_int4s_output_layer_asks_for_the_output_layers_engine(monkeypatch):
    """`quantize_int4`'s int8 output layer is put on `output_layer_engine`'s choice for its activations, as
    `quantize_int8`'s is (on a CPU whose int8 GEMM sums in int32 that is oneDNN, elsewhere the default)."""
    import tserve.model.quantize as quantize

    asked = []
    monkeypatch.setattr(quantize, "output_layer_engine", lambda activations: asked.append(activations))
    int4 = quantize_int4(_WithOutputLayer())
    assert asked == [int4.lm_head.activations] == [resolve_activations("auto")]


@pytest.mark.parametrize("activations", ["full", "split", "7bit", "7bit-weights"])
def test_the_activations_asked_for_reach_every_layer(activations):
    """`quantize_int8`'s choice is each layer's, the output layer's on its own engine too."""
    model = quantize_int8(_WithOutputLayer(), activations)
    assert model.body.activations == model.lm_head.activations == activations


@pytest.mark.parametrize("activations", ["full", "split", "7bit", "7bit-weights"])
def test_each_row_of_an_int8_weight_spans_its_levels(activations):
    """Every output row's largest weight takes the largest code: 127 levels each side, and 63 for
    `7bit-weights` (so that 8-bit activations cannot overflow an AVX2 kernel's int16 pair sums). Fewer levels
    would cost accuracy that only the test-split comparisons (marked slow) can measure."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    codes = Int8Linear(linear, activations).int8_weight()
    largest = 63 if activations == "7bit-weights" else 127
    assert torch.equal(codes.abs().amax(dim=1), torch.full((48,), largest, dtype=codes.dtype))


def test_full_is_refused_where_no_kernel_takes_8_bits(monkeypatch):
    """Where PyTorch's int8 GEMM would overflow and our exact kernel is not built (no compiler), `full` is
    refused with a clear error, by the resolver and by the layer, and `auto` falls back to `split`."""
    import tserve.model.quantize as quantize

    monkeypatch.setattr(quantize, "full_range_activations", lambda engine=None: False)
    monkeypatch.setattr(quantize.cpu_kernels, "available", lambda: False)
    assert quantize.full_activations_kernel() is None
    assert resolve_activations("auto") == "split"
    with pytest.raises(ValueError, match="overflow"):
        resolve_activations("full")
    with pytest.raises(ValueError, match="overflow"):
        Int8Linear(nn.Linear(64, 48), "full")


@pytest.mark.parametrize("activations", ["full", "split", "7bit", "7bit-weights"])
@pytest.mark.parametrize("bias", [True, False])
def test_our_row_kernels_give_the_values_of_pytorchs_calls(activations, bias):
    """`Int8Linear`'s forward on our C++ row mapping (tserve/model/kernels/int8_rows.cpp) equals, bit for bit, the
    chain of PyTorch calls it replaces, for wide and narrow layers, one row and many, a constant row among
    them. (`full` on PyTorch's kernel; on ours: tests/model/test_int8_gemm.py.)"""
    torch.manual_seed(1)
    for in_features, out_features in ((512, 1536), (2048, 512), (64, 200)):
        layer = Int8Linear(nn.Linear(in_features, out_features, bias=bias), activations, exact=False)
        for n in (1, 7, 32):
            x = torch.randn(n, in_features) * torch.rand(n, 1) * 3
            x[-1] = 0.25
            with torch.inference_mode():
                assert torch.equal(layer(x), layer._forward_in_steps(x)), (in_features, n)


PROBE = """
import json, torch
from torch import nn
from tserve.model.quantize import Int8Linear, resolve_activations
from tests.model.test_quantize import _long_tailed_rows, _relative_errors
torch.manual_seed(0)
linear = nn.Linear(64, 48)
rows = _long_tailed_rows()
layers = {name: Int8Linear(linear, name) for name in ("full", "split", "7bit", "7bit-weights")}
layers["full on PyTorch's kernel"] = Int8Linear(linear, "full", exact=False)
print(json.dumps({"auto": resolve_activations("auto"), "full is exact": layers["full"].exact,
                  **{name: _relative_errors(layer, linear, rows).max().item() for name, layer in layers.items()}}))
"""


def test_the_avx2_kernel_gets_full_activations_from_our_exact_gemm():
    """With fbgemm forced onto its AVX2 kernels (what a CPU without VNNI runs), 8-bit activations overflow
    PyTorch's int8 GEMM (the error this guards against), so `auto` is `full` on our exact kernel
    (tests/model/test_int8_gemm.py), as accurate as `full` anywhere; the other schemes stay within theirs."""
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": AVX2_ONLY["FBGEMM_ENABLE_INSTRUCTIONS"]}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["auto"] == "full" and got["full is exact"]
    assert got["full on PyTorch's kernel"] > 0.05  # int16 saturation: the overflow is real on this kernel
    assert got["full"] < ROW_ERROR["full"]
    assert got["split"] < ROW_ERROR["split"] and got["7bit"] < ROW_ERROR["7bit"]
    assert got["7bit-weights"] < ROW_ERROR["7bit-weights"]  # 8-bit activations that cannot overflow there


def test_int8_needs_float32_on_the_cpu(tiny_lm):
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        load(tiny_lm, dtype="bfloat16", quantize="int8")
    with pytest.raises(ValueError, match="quantize must be one of"):
        load(tiny_lm, quantize="int2")
    model = load(tiny_lm).model.to(torch.bfloat16)
    with pytest.raises(ValueError):
        quantize_int8(model)


def _bundled(name: str, quantize: str = "none", activations: str = "auto"):  # noqa: ANN202
    return load(ROOT / "models" / name, quantize=quantize, int8_activations=activations)


def _data_or_skip(fetch):  # noqa: ANN001, ANN202
    try:
        return fetch()
    except data_mod.DataPreparationError as exc:
        if os.environ.get("TSERVE_REQUIRE_DATA") or os.environ.get("CI") or os.environ.get("TSERVE_CI"):
            raise
        pytest.skip(f"test data unavailable and cannot be fetched: {exc}")


@functools.cache
def _float32_translations() -> tuple[list[str], list[str], list[str]]:
    """The en-de test split (all 2,214 sentences, 4 beams): sources, references and float32's translations."""
    from tserve.training.evaluate import translate

    pairs = _data_or_skip(lambda: data_mod.load_translation_pairs()["test"])
    sources, refs = [p.en for p in pairs], [p.de for p in pairs]
    return sources, refs, translate(_bundled("tserve-en-de"), sources)


def translator_agreement(quantize: str, activations: str = "auto") -> tuple[float, float, float]:
    """On the whole en-de test split, 4 beams: the share of translations identical to float32's, float32's chrF
    and the quantized model's. The whole split, not a slice: one sentence is 0.05% of it, so that the rounding
    of another CPU's float32 kernels, which can flip a few beam searches either way, cannot cross a bound."""
    from tserve.training.evaluate import bleu_chrf, translate

    sources, refs, fp32 = _float32_translations()
    quantized = translate(_bundled("tserve-en-de", quantize, activations), sources)
    identical = sum(a == b for a, b in zip(fp32, quantized, strict=True)) / len(sources)
    return identical, bleu_chrf(fp32, refs)["chrf"], bleu_chrf(quantized, refs)["chrf"]


def lm_perplexities(quantize: str) -> tuple[float, float]:
    """The bundled LM's perplexity on 20 test chunks, float32 and quantized."""
    from tserve.training.evaluate import evaluate_loaded

    path = ROOT / "models" / "tserve-lm"
    fp32 = _data_or_skip(lambda: evaluate_loaded(_bundled("tserve-lm"), path, limit=20, full=False))
    quantized = evaluate_loaded(_bundled("tserve-lm", quantize), path, limit=20, full=False)
    print(f"perplexity float32 {fp32['perplexity']}, {quantize} {quantized['perplexity']}")
    return fp32["perplexity"], quantized["perplexity"]


@pytest.mark.slow
def test_int8_translator_on_the_test_split():
    """chrF within 1.0 of float32 and at least 90% of the 4-beam translations identical, on the path this
    machine takes (91.1% with full 8-bit activations, 94.4% with split ones; docs/BENCHMARKS.md)."""
    identical, chrf_fp32, chrf_int8 = translator_agreement("int8")
    print(f"activations {resolve_activations('auto')}: chrF float32 {chrf_fp32}, int8 {chrf_int8}; "
          f"identical {identical:.1%}")
    assert abs(chrf_int8 - chrf_fp32) <= 1.0
    assert identical >= 0.90


@pytest.mark.slow
def test_int8_translator_with_7bit_weights_on_the_test_split():
    """8-bit activations on 7-bit weights (one GEMM that no kernel can overflow, for AVX2-only CPUs that want
    speed over `split`): chrF within 1.0 of float32, and the agreement measured, 86.9% identical (7-bit
    activations: 86.0%), with a margin of 2 points (44 sentences) for other CPUs' float32 rounding."""
    identical, chrf_fp32, chrf_int8 = translator_agreement("int8", "7bit-weights")
    print(f"activations 7bit-weights: chrF float32 {chrf_fp32}, int8 {chrf_int8}; identical {identical:.1%}")
    assert abs(chrf_int8 - chrf_fp32) <= 1.0
    assert identical >= 0.85


@pytest.mark.slow
def test_int8_language_model_perplexity_within_2_percent():
    fp32, int8 = lm_perplexities("int8")
    assert int8 == pytest.approx(fp32, rel=0.02)


@pytest.mark.slow
def test_int8_vit_accuracy_within_0_3_points():
    from tserve.training.evaluate import evaluate_loaded

    path = ROOT / "models" / "tserve-vit-fashion"
    fp32 = _data_or_skip(lambda: evaluate_loaded(_bundled("tserve-vit-fashion"), path, limit=1000, full=False))
    int8 = evaluate_loaded(_bundled("tserve-vit-fashion", "int8"), path, limit=1000, full=False)
    print(f"accuracy float32 {fp32['accuracy']}, int8 {int8['accuracy']}")
    assert abs(int8["accuracy"] - fp32["accuracy"]) <= 0.003


# int4 on the same splits, beside int8 (not in test_int4.py): one worker then translates with float32 once for both.
@pytest.mark.slow
def test_int4_language_model_perplexity_within_3_percent():
    fp32, int4 = lm_perplexities("int4")
    assert int4 == pytest.approx(fp32, rel=0.03)


def lm_agreement(quantize: str) -> float:
    """Teacher-forced next tokens of the bundled LM quantized as `quantize` against float32's, on its first 20 test
    texts (12,437 positions): the share that agree."""
    from tserve.training.lm import strided_top1_agreement, token_stream

    test = _data_or_skip(lambda: data_mod.load_lm_corpus()["test"])
    fp32, quantized = _bundled("tserve-lm"), _bundled("tserve-lm", quantize)
    stream = token_stream(quantized.tokenizer, list(test[:20]))
    context = quantized.model.cfg.max_seq_len
    agreement, positions = strided_top1_agreement(fp32.model, quantized.model, stream, context, context // 2)
    print(f"{quantize} next-token agreement {agreement:.2%} over {positions} positions")
    return agreement


@pytest.mark.slow
def test_int4_next_tokens_agree_with_float32s_with_the_output_layer_int8():
    """`--quantize int4` on the first 20 test texts: 89.1% with the output layer int8, 85.9% were it int4 too (the
    whole split: 88.94% and 85.68%, docs/benchmarks/roofline.md)."""
    assert lm_agreement("int4") >= 0.88


@pytest.mark.slow
def test_q4_0_next_tokens_agree_with_float32s_with_the_output_layer_q8_0():
    """`--quantize q4_0`: its output layer Q8_0 (llama.cpp's Q4_0 files keep theirs at 6-8 bits), every other layer
    Q4_0 with least-squares scales. The first 20 test texts: 87.3%, 84.0% were the output layer Q4_0 too (the whole
    split: 87.54% and 83.89%; with llama.cpp's reference scales 86.85% and 83.31%)."""
    assert lm_agreement("q4_0") >= 0.86


@pytest.mark.slow
def test_int4_translator_on_the_test_split():
    """chrF within 1.0 of float32. Identical 4-beam translations on the whole test split: 69.2% measured with the
    output layer int8 (66.0% with an int4 one; the goal of 80% is missed, docs/BENCHMARKS.md); at least 60%
    guards against a worse quantizer."""
    identical, chrf_fp32, chrf_int4 = translator_agreement("int4")
    print(f"chrF float32 {chrf_fp32}, int4 {chrf_int4}; identical {identical:.1%}")
    assert abs(chrf_int4 - chrf_fp32) <= 1.0
    assert identical >= 0.60
