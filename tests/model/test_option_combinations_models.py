"""Loading and serving models where two options meet: a numeric format with an untied output layer or a half
precision dtype, the fused decode step with Granite's multipliers, served (fused) gated MLPs with biases, Gemma 2's
soft-capped attention in cached decode steps, and rope scalings at the edge of their original context. Each
option has its own tests in its module, mostly on one default configuration; these check the combinations."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import factories
from tests.model.test_fused_decode import paged_cache, steps
from tserve.model import rope
from tserve.model.block_quant import BlockLinear
from tserve.model.checkpoint import load
from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.model.fused_decode import FusedDecode
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.layers import fuse_gated_mlps
from tserve.model.packed_linear import pack_linears
from tserve.model.quantize import Int4Linear, Int8Linear, quantize_blocks, quantize_int4

# The outcome depends on the CPU's kernels (block formats, the fused step): `make test-avx2` runs it on AVX2 ones too.
pytestmark = pytest.mark.kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the fused step needs the CPU kernels")

LLAMA = dict(vocab_size=97, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128, max_seq_len=64,
             norm="rmsnorm", activation="swiglu", positions="rope", bias=False)


def _behaving(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    """Weights large enough that every layer moves the residual stream, biases and norms away from their defaults
    (a zero bias or a unit norm hides which of two tensors a layer was given)."""
    torch.manual_seed(seed)
    model = Decoder(cfg, backend="cpu-decode").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand_like(p) * 0.5 + 0.75)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.3)
    return model


# --- the output layer of a 4-bit format, tied or not ---------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fmt", ["q4_0", "int4"])
def test_a_4_bit_formats_output_layer_keeps_8_bits_whether_or_not_it_is_tied(fmt, tied):
    """Under q4_0 the output (vocabulary) layer is Q8_0 and under int4 it is int8, as llama.cpp keeps `output.weight`
    (or the tied `token_embd.weight`) at 8 bits or more: Llama 3 and Qwen3 have an untied output layer, Qwen2 and
    SmolLM a tied one. Every other layer holds the 4-bit format, and the embedding stays float32."""
    model = _behaving(DecoderConfig(**LLAMA, tie_embeddings=tied))
    fuse_gated_mlps(model)
    if fmt == "q4_0":
        quantize_blocks(model, "q4_0")
        assert isinstance(model.lm_head, BlockLinear) and model.lm_head.fmt == "q8_0"
        assert {m.fmt for m in model.blocks.modules() if isinstance(m, BlockLinear)} == {"q4_0"}
    else:
        quantize_int4(model)
        assert isinstance(model.lm_head, Int8Linear)
        assert all(isinstance(m, Int4Linear) for m in (model.blocks[0].attn.qkv, model.blocks[1].mlp.fc2))
    assert model.tok_emb.weight.dtype == torch.float32


# --- block formats need a float32 model -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_block_formats_refuse_a_half_precision_model_at_load(tiny_lm, fmt, dtype):
    """`--quantize q8_0 / q4_0` with `--dtype bfloat16 / float16` is refused when the model loads, as int8 and int4
    are: the blocks' products give float32 back, which a half precision model's norms refuse only at its first
    request."""
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        load(tiny_lm, dtype=dtype, quantize=fmt)


# --- Granite's multipliers on the fused decode step ----------------------------------------------------------------
def _teacher_forced_logits(loaded, ids: list[int], prompt: int) -> list[torch.Tensor]:  # noqa: ANN001
    """The logits of each one-token decode step after prefilling `ids[:prompt]`, fed the rest of `ids`."""
    model = loaded.model
    cache = paged_cache(model, 1, seed=3)
    slots = torch.tensor([0])
    out = [model.prefill(torch.tensor([ids[:prompt]]), torch.tensor([prompt]), cache, slots)[0]]
    for position in range(prompt, len(ids)):
        out.append(model.decode_step([ids[position]], [position], cache, [0])[0])
    return out


@needs_kernels
@pytest.mark.parametrize("quantize", ["none", "q8_0"])
def test_granites_fused_decode_steps_keep_its_embedding_multiplier_and_logits_scaling(tmp_path, quantize):
    """Granite served as `tserve serve` loads it on a CPU (pre-packed, `--fused-layers`, with or without Q8_0
    blocks): each decode step's logits equal the layer-by-layer step's on the same weights, which divide the logits by
    `logits_scaling` and multiply the embeddings by `embedding_multiplier`. Logits scaling keeps the greedy token but
    changes every logprob and every sampled token."""
    d = factories.hf_family_dir("granite", tmp_path / "granite")
    raw = json.loads((d / "config.json").read_text())
    assert raw["logits_scaling"] != 1.0 and raw["embedding_multiplier"] != 1.0
    served = load(d, pack_weights=True, fused_layers=True, quantize=quantize)
    assert served.model.fused is not None
    layered = load(d, quantize=quantize)
    assert layered.model.fused is None
    ids = served.tokenizer.encode("The quick brown fox jumps over the lazy dog, and the dog sleeps on.")[:24]
    with torch.no_grad():
        fused, by_layers = _teacher_forced_logits(served, ids, 6), _teacher_forced_logits(layered, ids, 6)
    tolerance = 1e-4 if quantize == "none" else 0.05  # block formats: an activation code may move by one step
    for step, (a, b) in enumerate(zip(by_layers[1:], fused[1:], strict=True)):
        assert (a - b).abs().max() <= tolerance * max(1.0, float(a.abs().max())), f"step {step}"


# --- a served gated MLP with biases --------------------------------------------------------------------------------
@needs_kernels
def test_a_gated_mlps_biases_follow_its_gate_and_up_projections_when_served_as_one(tmp_path):
    """`mlp_bias` (InternLM-style Llama checkpoints): a served model computes the MLP's gate and up projections as
    one product (`fuse_gated_mlps`), their biases concatenated in the weights' order. The served model, layer by layer
    and in the fused decode step, computes what the model as loaded computes."""
    model = _behaving(DecoderConfig(**LLAMA, mlp_bias=True))
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = model(tokens)
    layered = steps(model, None, [[5, 17, 3], [40, 2, 9, 11, 60]], 6)
    fuse_gated_mlps(model)
    assert model.blocks[0].mlp.gate_fc1.bias is not None
    pack_linears(model)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference, atol=1e-4, rtol=1e-4)
    fused = FusedDecode.build(model)
    assert fused is not None
    for a, b in zip(layered, steps(model, fused, [[5, 17, 3], [40, 2, 9, 11, 60]], 6), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


# --- Gemma 2's soft-capped attention in cached decode steps --------------------------------------------------------
@pytest.mark.parametrize("served", [False, True], ids=["as-loaded", "as-served"])
def test_gemma2s_decode_steps_soft_cap_their_attention_scores_as_the_whole_forward_does(tmp_path, served):
    """Gemma 2 caps its attention scores (4 in the fixture, small enough to matter), which no decode kernel does: its
    one-token steps over the paged cache take the capped `math` path, on the default CPU backend (`cpu-decode`) and as
    served (`--fused-layers`, which does not fuse soft-capped attention). Each step's logits equal the uncached
    forward's over the whole text."""
    d = factories.hf_family_dir("gemma2", tmp_path / "gemma2")
    loaded = load(d, pack_weights=True, fused_layers=True) if served else load(d)
    model = loaded.model
    assert loaded.config.attention_softcap is not None and model.fused is None
    tokens = loaded.tokenizer.encode("The quick brown")
    cache = model.new_cache(1, 64, num_blocks=20, block_size=4)
    cache.set_table(0, list(range(19, 3, -1)))
    with torch.no_grad():
        logits = model.prefill(torch.tensor([tokens]), torch.tensor([len(tokens)]), cache, torch.tensor([0]))[0]
        while len(tokens) < 30:
            torch.testing.assert_close(logits, model(torch.tensor([tokens]))[0, -1], atol=1e-4, rtol=1e-4)
            tokens.append(int(logits.argmax()))
            logits = model.decode_step(torch.tensor([tokens[-1]]), torch.tensor([len(tokens) - 1]), cache,
                                       torch.tensor([0]), kv_len=len(tokens))[0]


# --- rope scalings around the original context ---------------------------------------------------------------------
def test_longrope_switches_to_the_long_factors_at_the_original_context():
    """transformers rotates a sequence of more than `original_max_position_embeddings` tokens with the long factors:
    decoding token by token, the token at position `original` (the original + 1-th) is the first rotated with them,
    times the attention factor; the one before it keeps the short factors. Partial rotary (Phi-4-mini) has as many
    factors as rotated pairs."""
    rotated, original, base = 8, 32, 10000.0
    short, long = [1.0, 1.5, 2.0, 3.0], [2.0, 4.0, 8.0, 16.0]
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long, "factor": 4.0,
               "original_max_position_embeddings": original}
    cos, sin = rope.tables(rotated, 64, base, scaling)
    attention = math.sqrt(1 + math.log(4.0) / math.log(original))
    exponents = torch.arange(0, rotated, 2).float() / rotated
    for position, factors, scale in ((original - 1, short, attention), (original, long, attention),
                                     (original + 1, long, attention)):
        angles = position / (torch.tensor(factors) * base**exponents)
        torch.testing.assert_close(cos[position], angles.cos() * scale, atol=1e-5, rtol=0)
        torch.testing.assert_close(sin[position], angles.sin() * scale, atol=1e-5, rtol=0)


def test_dynamic_rope_scaling_extends_the_context_a_checkpoint_is_served_for(tmp_path):
    """`dynamic` (NTK-aware) scaling is for texts past the trained context: an imported checkpoint is served up to
    `factor` times `max_position_embeddings`, and its positions there rotate with the bases of their own sequence
    lengths (`model.rope`), not the default's."""
    d = factories.hf_family_dir("qwen3", tmp_path / "qwen3")
    raw = json.loads((d / "config.json").read_text())
    trained = raw["max_position_embeddings"]
    raw["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    (d / "config.json").write_text(json.dumps(raw))
    loaded = load(d)
    cfg = loaded.config
    assert cfg.max_seq_len == 2 * trained
    assert cfg.rope_scaling["max_position_embeddings"] == trained
    assert loaded.model.rope_cos.size(0) == 2 * trained
    expected, _ = rope.tables(cfg.d_head, 2 * trained, 1e6, cfg.rope_scaling)
    default, _ = rope.tables(cfg.d_head, 2 * trained, 1e6)
    torch.testing.assert_close(loaded.model.rope_cos, expected)
    assert (expected[trained + 10] - default[trained + 10]).abs().max() > 1e-3
    # A text longer than the trained context fits one row of the cache and runs.
    ids = torch.randint(0, cfg.vocab_size, (1, trained + 20), generator=torch.Generator().manual_seed(5))
    cache = loaded.model.new_cache(1)
    with torch.no_grad():
        logits = loaded.model.prefill(ids, torch.tensor([ids.size(1)]), cache, torch.tensor([0]))
    assert torch.isfinite(logits).all()



@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_layers_alone_fuse_a_gated_models_steps(tmp_path, family):
    """`load(path, fused_layers=True)` without pre-packed weights (a program that loads a model itself, not through
    `tserve serve`): the fused step needs the gate and up projections as one product, which are merged for it too,
    and its steps compute what the layers' steps compute."""
    d = factories.hf_family_dir(family, tmp_path / family)
    fused, layered = load(d, fused_layers=True), load(d)
    assert fused.model.fused is not None and layered.model.fused is None
    ids = fused.tokenizer.encode("The quick brown fox jumps over the lazy dog.")[:12]
    with torch.no_grad():
        for a, b in zip(_teacher_forced_logits(layered, ids, 4)[1:], _teacher_forced_logits(fused, ids, 4)[1:],
                        strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
