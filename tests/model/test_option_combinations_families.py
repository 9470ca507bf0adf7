"""The model families' importers where a config option leaves the fixture's default: attention biases on families
whose fixtures have none, untied output layers on families whose fixtures tie them, windows and position-free
layers read from older config layouts, a T5 decoder deeper than its encoder, a soft cap on the `math` and `sdpa`
backends, and Gemma's (1 + w) norms and embedding scale in bfloat16. Each family has its parity tests against `transformers` on its
fixture (tests/model/test_llama_family.py, test_t5.py); these check the options its fixture does not set."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import factories
from tests.model.test_llama_family import _hf
from tests.model.test_t5 import TEXTS as T5_TEXTS
from tests.model.test_t5 import _padded_logits
from tserve.model.checkpoint import load
from tserve.model.norms import RMSNorm

# The outcome depends on the CPU's kernels: `make test-avx2` runs it on AVX2 ones too.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")


def _edit(d, **fields) -> dict:
    """config.json with `fields` set (None: removed); returns the new config."""
    raw = json.loads((d / "config.json").read_text())
    raw |= {k: v for k, v in fields.items() if v is not None}
    for k in [k for k, v in fields.items() if v is None]:
        raw.pop(k, None)
    (d / "config.json").write_text(json.dumps(raw))
    return raw


def _add_tensors(d, make) -> None:  # noqa: ANN001
    """model.safetensors with the tensors `make(weights)` returns added to it."""
    weights = load_file(d / "model.safetensors")
    weights |= make(weights)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})


def _tokens(vocab: int, length: int = 60, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _loaded_before_and_after(d, **fields):  # noqa: ANN001, ANN003, ANN202 - (LoadedModel, LoadedModel)
    """The checkpoint loaded as it is, then with `fields` edited into its config.json; their logits are asserted
    equal (the edit writes what the importer's default must read the same)."""
    before = load(d)
    _edit(d, **fields)
    after = load(d)
    tokens = _tokens(before.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(after.model(tokens), before.model(tokens))
    return before, after


def _assert_logits_equal_transformers(d, **load_options) -> None:  # noqa: ANN001
    ours, hf = load(d, **load_options), _hf(d)
    tokens = _tokens(ours.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours.model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


# --- attention biases ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3", "smollm3", "granite", "gemma3"])
def test_attention_biases_on_the_query_key_value_and_output_projections_equal_transformers(tmp_path, family):
    """`attention_bias: true` (InternLM-style Llama checkpoints, some Qwen3 and Granite fine-tunes) puts a bias on
    q, k, v and o alike; the fixtures have none. Every one of the four is read: a dropped output bias shifts every
    position's residual by the same vector and still loads without complaint."""
    d = factories.hf_family_dir(family, tmp_path / family)
    raw = _edit(d, attention_bias=True)
    gen = torch.Generator().manual_seed(7)

    def biases(weights: dict) -> dict:
        return {f"model.layers.{i}.self_attn.{p}_proj.bias":
                torch.randn(weights[f"model.layers.{i}.self_attn.{p}_proj.weight"].size(0), generator=gen) * 0.5
                for i in range(raw["num_hidden_layers"]) for p in "qkvo"}

    _add_tensors(d, biases)
    loaded = load(d)
    assert loaded.model.blocks[0].attn.proj.bias is not None and loaded.model.blocks[0].attn.qkv.bias is not None
    _assert_logits_equal_transformers(d)


# --- untied output layers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "smollm3", "granite", "gemma3"])
def test_an_untied_output_layer_is_read_in_families_whose_fixtures_tie_it(tmp_path, family):
    """`tie_word_embeddings: false` with an `lm_head.weight` of its own (larger Qwen2.5 and Granite models): the
    output layer is that matrix, not the embedding. Some families' configs default the key to true (Granite,
    Gemma), so a default merged over the config instead of under it ties a checkpoint that says it is untied, and
    its own output layer, never read, is dropped without an error."""
    d = factories.hf_family_dir(family, tmp_path / family)
    _edit(d, tie_word_embeddings=False)
    _add_tensors(d, lambda w: {"lm_head.weight": torch.randn(
        next(v for k, v in w.items() if k.endswith("embed_tokens.weight")).shape,
        generator=torch.Generator().manual_seed(3)) * 0.1})
    loaded = load(d)
    assert not loaded.config.tie_embeddings
    assert loaded.model.lm_head.weight.data_ptr() != loaded.model.tok_emb.weight.data_ptr()
    _assert_logits_equal_transformers(d)


# --- windows and positions from older config layouts ---------------------------------------------------------------
def test_mistral_slides_every_layer_when_its_config_sets_a_window_without_layer_types(tmp_path):
    """Mistral 7B v0.1's config: `sliding_window: 4096` and no `layer_types`: every layer attends within the window
    (as Phi-3's do), as transformers reads it; the fixture sets no window. Past the window the logits differ from
    the unwindowed model's, and equal transformers'."""
    d = factories.hf_family_dir("mistral", tmp_path / "mistral")
    unwindowed = load(d)
    raw = _edit(d, sliding_window=12, layer_types=None)
    loaded = load(d)
    assert (loaded.config.sliding_window, loaded.config.sliding_layers) == (12, list(range(raw["num_hidden_layers"])))
    tokens = _tokens(loaded.config.vocab_size, 40)
    with torch.no_grad():
        got = loaded.model(tokens)
        torch.testing.assert_close(got, _hf(d)(tokens).logits, atol=1e-4, rtol=1e-4)
        assert (got - unwindowed.model(tokens)).abs().max() > 1e-2


def test_gemma2_configs_without_layer_types_slide_every_other_layer(tmp_path):
    """Gemma 2's hub configs predate `layer_types`: its layers alternate, sliding first (Gemma 3's older configs
    slide five of every `sliding_window_pattern` = 6 instead). Without the key the fixture is the same model."""
    reference, older = _loaded_before_and_after(factories.hf_family_dir("gemma2", tmp_path / "gemma2"),
                                                layer_types=None)
    assert reference.config.sliding_layers == older.config.sliding_layers == [0]


def test_smollm3_without_no_rope_layers_leaves_every_intervalth_layer_without_positions(tmp_path):
    """A SmolLM3 config without `no_rope_layers` (hand-written; save_pretrained always writes the list): as
    SmolLM3Config defaults it, every `no_rope_layer_interval`-th layer (the 2nd, 4th, ... with an interval of 2)
    takes no positions, not the first. The fixture's second layer is the one without positions."""
    reference, default = _loaded_before_and_after(factories.hf_family_dir("smollm3", tmp_path / "smollm3"),
                                                  no_rope_layers=None, no_rope_layer_interval=2)
    assert reference.config.nope_layers == default.config.nope_layers == [1]


# --- a T5 decoder deeper than its encoder --------------------------------------------------------------------------
def test_a_t5_decoder_of_its_own_depth_reads_every_layer(tmp_path):
    """`num_decoder_layers` differs from `num_layers` in some T5 variants (the efficient T5s, deep-encoder
    shallow-decoder translators): the decoder has as many layers as it says, each read from the checkpoint; a
    decoder built as deep as the encoder leaves its last layer unread without an error."""
    d = factories.hf_t5_dir(tmp_path / "t5")
    _edit(d, num_decoder_layers=3)
    gen = torch.Generator().manual_seed(5)
    _add_tensors(d, lambda w: {k.replace("decoder.block.1.", "decoder.block.2."):
                               v + torch.randn(v.shape, generator=gen) * 0.05
                               for k, v in w.items() if k.startswith("decoder.block.1.")})
    ours = load(d)
    assert (ours.config.n_encoder_layers, ours.config.n_decoder_layers) == (2, 3)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(d).eval()
    got, ref = _padded_logits(ours, hf, T5_TEXTS)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# --- attention backends --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3", "phi3"])
def test_every_cpu_backend_computes_each_familys_attention(tmp_path, family, backend):
    """`--attention math` or `sdpa` instead of the default: Gemma 2's soft-capped scores (which no fused kernel
    caps: those layers take the capped `math` path whatever the backend, `math` included), Gemma 3's scaled
    queries and sliding layer, Qwen3's q/k norms, Phi-3's partial rotary and window. The logits equal
    transformers' on each."""
    d = factories.hf_family_dir(family, tmp_path / family)
    _assert_logits_equal_transformers(d, backend=backend)


# --- Gemma's norms in half precision -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemmas_offset_norms_in_bfloat16_are_transformers_bit_for_bit(tmp_path, family):
    """Gemma's RMSNorms scale by (1 + w), computed in float32 and rounded once: in bfloat16 a rounded 1 + w (steps
    of 1/128 near one) or a normed input rounded before the product moves many outputs by a unit in the last place.
    Every offset norm of the model loaded with `dtype="bfloat16"` (the blocks', the final one, Gemma 3's q/k
    norms) gives transformers' Gemma RMSNorm's output exactly."""
    module = getattr(transformers.models, family)
    reference_norm = getattr(module, f"modeling_{family}").__dict__[f"{family.capitalize()}RMSNorm"]
    loaded = load(factories.hf_family_dir(family, tmp_path / family), dtype="bfloat16")
    norms = [m for m in loaded.model.modules() if isinstance(m, RMSNorm) and m.offset]
    assert len(norms) >= 4 * loaded.config.n_layers + 1
    gen = torch.Generator().manual_seed(11)
    for norm in norms:
        dim = norm.weight.numel()
        theirs = reference_norm(dim, eps=norm.eps).to(torch.bfloat16)
        with torch.no_grad():
            theirs.weight.copy_(norm.weight)
            x = (torch.randn(3, 7, dim, generator=gen) * 3).to(torch.bfloat16)
            assert torch.equal(norm(x), theirs(x))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemmas_embedding_scale_in_bfloat16_is_rounded_as_transformers_rounds_it(tmp_path, family):
    """Gemma scales its embeddings by sqrt(d_model) rounded to the weights' dtype first (transformers:
    `normalizer` / `embed_scale.to(weight.dtype)`): at a width whose root bfloat16 cannot hold (72: 8.485 -> 8.5),
    the embeddings of the model loaded in bfloat16 are those, bit for bit, not the product with the exact root."""
    d = factories.hf_family_dir(family, tmp_path / family)
    loaded = load(d, dtype="bfloat16")
    model = loaded.model
    model.cfg = type(model.cfg)(**{**model.cfg.__dict__, "d_model": 72})  # the scale's width only
    model.embed_scale = 72 ** 0.5
    tokens = torch.arange(1, 40).view(3, 13)
    with torch.no_grad():
        ours = model._embed(tokens, torch.arange(13))[0]
        rows = model.tok_emb(tokens)
        theirs = rows * torch.tensor(72 ** 0.5, dtype=torch.bfloat16)
        assert torch.equal(ours, theirs)
        assert not torch.equal(ours, rows * 72 ** 0.5)  # the width tells the two apart
