"""`load(..., pack_weights=True)` (what the server loads): every float32 linear layer on the CPU runs on a
pre-packed weight and computes what `nn.Linear` computes; a row's result does not depend on how many rows
share the product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tserve.model.checkpoint import load
from tserve.model.packed_linear import OneDNNLinear, PackedLinear, pack_linears

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


def _inputs(loaded, which: str) -> tuple:  # noqa: ANN001
    if which == "lm":
        return (torch.tensor([loaded.tokenizer.encode("Hello world, good morning to you")]),)
    if which == "mt":
        src = torch.tensor([loaded.tokenizer.encode("Good morning, my friend.")])
        return src, torch.tensor([src.size(1)]), torch.tensor([[loaded.config.decoder_start_token_id, 5, 6, 7]])
    cfg = loaded.config
    return (torch.rand(2, cfg.n_channels, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("which", ["lm", "mt", "vit"])
def test_packed_linear_layers_compute_what_nn_linear_computes(which, tiny_lm, tiny_mt, tiny_vit):
    path = {"lm": tiny_lm, "mt": tiny_mt, "vit": tiny_vit}[which]
    plain, packed = load(path), load(path, pack_weights=True)
    n_linear = sum(type(m) is nn.Linear for m in plain.model.modules())
    assert n_linear > 0 and not any(type(m) is nn.Linear for m in packed.model.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == n_linear
    assert packed.num_parameters() == plain.num_parameters()
    with torch.inference_mode():
        torch.testing.assert_close(packed.model(*_inputs(packed, which)), plain.model(*_inputs(plain, which)),
                                   atol=1e-5, rtol=1e-5)


def test_a_row_gets_the_same_result_in_any_batch():
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(64, 96))
    x = torch.randn(40, 64)
    with torch.inference_mode():
        together = layer(x)
        for rows in (1, 3, 7, 16, 33):
            assert torch.equal(layer(x[:rows]), together[:rows])


def test_other_dtypes_and_int8_keep_their_layers(tiny_lm):
    model = load(tiny_lm).model.to(torch.bfloat16)
    assert pack_linears(model) == 0 and any(type(m) is nn.Linear for m in model.modules())
    int8 = load(tiny_lm, quantize="int8", pack_weights=True)
    assert int8.quantization == "int8" and not any(isinstance(m, PackedLinear) for m in int8.model.modules())


def test_a_fused_float32_model_runs_its_other_products_on_onednn_over_the_weights_the_fused_step_reads(tiny_lm):
    """Served with fused decode steps, a float32 model keeps its weights as stored (the fused step reads them);
    prefill's products run on oneDNN over those very tensors (`OneDNNLinear`, not `F.linear`'s BLAS, 2-3x
    slower on an AMD EPYC), give what the plain model gives, and the steps can be fused again over them."""
    plain, served = load(tiny_lm), load(tiny_lm, pack_weights=True, fused_layers=True)
    assert served.model.fused is not None
    linears = [m for m in served.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    assert served.model.fuse_decode()  # the fused step takes these layers' weights as they are
    prompt = _inputs(served, "lm")
    with torch.inference_mode():
        torch.testing.assert_close(served.model(*prompt), plain.model(*prompt), atol=1e-5, rtol=1e-5)


def test_a_row_gets_the_same_result_in_any_batch_on_the_stored_weight_too():
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    layer.__class__ = OneDNNLinear
    x = torch.randn(40, 64)
    with torch.inference_mode():
        together = layer(x)
        torch.testing.assert_close(together, nn.functional.linear(x, layer.weight, layer.bias))
        for rows in (1, 3, 7, 16, 33):
            assert torch.equal(layer(x[:rows]), together[:rows])

