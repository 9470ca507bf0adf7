"""What the inspection features compute where they meet a family's options: attention maps of grouped-query models
(a head selection past the kv heads, a one-token input) and of soft-capped attention (Gemma 2), the logit lens of
families whose output layer is soft-capped (Gemma 2) or scaled (Granite), attention maps of a bfloat16 image model,
and text embeddings of a batch of different lengths under sliding windows and quantized weights. `transformers`'
`output_attentions` / `output_hidden_states` on the same weights is the reference; the same input alone is the
reference of a batch. The fixtures' HTTP parity tests run Gemma 2 and Granite only as slow tests, and compare
the lens by its top token only."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import factories
from tserve.model import attention_maps as am
from tserve.model import logit_lens as lens
from tserve.model.checkpoint import load
from tserve.model.embeddings import embed_token_lists

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")

TEXT = "Hello world, good morning"
FAMILIES = ("llama", "gemma2", "granite", "phi3", "gemma3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspection-families")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


def _hf(d):  # noqa: ANN001, ANN202
    # eager: the only implementation that hands back the attention probabilities
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()


def _stacked(maps: list[am.AttentionMap]) -> torch.Tensor:
    return torch.stack([m.weights for m in maps])  # (layers, heads, query, key)


# --- attention maps -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_grouped_query_maps_of_every_query_head_equal_transformers(checkpoints, family):
    """Every query head's map, each layer, against `output_attentions`: with 4 query heads on 2 kv heads the heads
    past the kv heads' count are selectable on their own, and Gemma 2's maps are those of its soft-capped scores
    (the capped scores are what the model attends with)."""
    loaded, hf = load(checkpoints[family]), _hf(checkpoints[family])
    assert loaded.config.kv_heads < loaded.config.n_heads
    ids = loaded.tokenizer.encode(TEXT)
    with torch.no_grad():
        ref = torch.stack([a[0] for a in hf(torch.tensor([ids]), output_attentions=True).attentions])
    torch.testing.assert_close(_stacked(am.lm_attention_ids(loaded, ids)), ref, atol=1e-5, rtol=0)
    upper = am.lm_attention_ids(loaded, ids, layers=[1], heads=[2, 3])
    torch.testing.assert_close(upper[0].weights, ref[1, [2, 3]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_one_token_input_has_a_map_per_query_head(checkpoints, family):
    """A one-token input on a grouped-query model (soft-capped or not): a 1 x 1 map of weight one for each of the
    query heads, not the kv heads' shortcut that keeps no weights."""
    loaded = load(checkpoints[family])
    (token,) = loaded.tokenizer.encode("Hello")[:1]
    maps = am.lm_attention_ids(loaded, [token])
    assert len(maps) == loaded.config.n_layers
    for m in maps:
        assert m.weights.shape == (loaded.config.n_heads, 1, 1)
        torch.testing.assert_close(m.weights, torch.ones(loaded.config.n_heads, 1, 1))


def test_soft_capped_maps_are_the_same_with_every_backend(checkpoints):
    """The maps come from the `math` path whichever backend serves: a Gemma 2 loaded for `sdpa` or the CPU decode
    kernel gives the capped maps its `math` load gives."""
    d = checkpoints["gemma2"]
    ids = load(d).tokenizer.encode(TEXT)
    want = _stacked(am.lm_attention_ids(load(d, backend="math"), ids))
    for backend in ("sdpa", "cpu-decode"):
        torch.testing.assert_close(_stacked(am.lm_attention_ids(load(d, backend=backend), ids)), want,
                                   atol=1e-6, rtol=0)


def test_bfloat16_image_models_attention_maps(tiny_vit):
    """A ViT loaded in bfloat16: its maps are float32 distributions close to the float32 model's."""
    pixels = torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(0))
    want = _stacked(am.vit_attention(load(tiny_vit), pixels))
    got = am.vit_attention(load(tiny_vit, dtype="bfloat16"), pixels)
    assert all(m.weights.dtype == torch.float32 for m in got)
    torch.testing.assert_close(_stacked(got), want, atol=3e-2, rtol=0)


# --- the logit lens -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_lens_probabilities_carry_the_output_layers_cap_and_scaling(checkpoints, family):
    """The lens's last layer is the model's own next-token distribution, probabilities included: Gemma 2's logits
    are soft-capped and Granite's divided by its logits scaling, which moves every probability though not the
    ranking. Layer 0 is the embedding output (Gemma's scaled embeddings) through the final norm and that head."""
    loaded, hf = load(checkpoints[family]), _hf(checkpoints[family])
    ids = loaded.tokenizer.encode(TEXT)
    last = lens.n_layers(loaded) - 1
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        logits0 = hf.lm_head(hf.model.norm(out.hidden_states[0]))[0]
    cap, divisor = getattr(hf.config, "final_logit_softcapping", None), getattr(hf.config, "logits_scaling", 1.0)
    logits0 = logits0 / divisor
    if cap is not None:
        logits0 = torch.tanh(logits0 / cap) * cap
    answer = {layer.layer: layer for layer in lens.logit_lens(loaded, ids, [0, last], top_k=3)}
    for layer, logits in ((last, out.logits[0]), (0, logits0)):
        probs = torch.softmax(logits.float(), -1)
        want, want_ids = probs.topk(3, dim=-1)
        assert answer[layer].top_ids == want_ids.tolist(), layer
        torch.testing.assert_close(torch.tensor(answer[layer].top_probs), want, atol=1e-5, rtol=0)


# --- embeddings ---------------------------------------------------------------------------------------------------
EMBED_TEXTS = ["Hello", "Where is the station? " * 5, "the cat sat on the mat"]  # the second past Gemma 3's window


@pytest.mark.parametrize(("family", "quantize"), [("phi3", "none"), ("gemma3", "none"), ("llama", "int8"),
                                                  ("llama", "q8_0"), ("llama", "int4"), ("gemma3", "q4_0")])
def test_a_batch_of_different_lengths_embeds_each_text_as_alone(checkpoints, family, quantize):
    """Mean pooling over each text's own tokens in one right-padded batch, with sliding windows (Phi-3's every
    layer, Gemma 3's first) and quantized weights whose activations are quantized per token: every row equals
    the text embedded alone, a unit vector."""
    loaded = load(checkpoints[family], quantize=quantize)
    lists = [loaded.tokenizer.encode(t) for t in EMBED_TEXTS]
    assert len({len(t) for t in lists}) == len(lists)
    if family == "gemma3":
        assert max(map(len, lists)) > loaded.config.sliding_window
    batch = embed_token_lists(loaded, lists)
    for i, ids in enumerate(lists):
        torch.testing.assert_close(batch[i], embed_token_lists(loaded, [ids])[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(batch.norm(dim=-1), torch.ones(len(lists)))


def test_embeddings_with_sliding_layers_equal_transformers_mean_hidden_state(checkpoints):
    """Gemma 3 (a sliding first layer, (1 + w) norms, scaled embeddings), a text past its window: the mean of
    `transformers`' last hidden state (after its final norm), normalised."""
    loaded, hf = load(checkpoints["gemma3"]), _hf(checkpoints["gemma3"])
    ids = loaded.tokenizer.encode(EMBED_TEXTS[1])
    with torch.no_grad():
        state = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    want = torch.nn.functional.normalize(state.mean(0), dim=-1)
    torch.testing.assert_close(embed_token_lists(loaded, [ids])[0], want, atol=1e-5, rtol=0)


def test_a_t5_translators_last_lens_layer_is_its_own_prediction(tmp_path):
    """T5's decoder reads positions from a relative bias that also carries the causal rule: the lens runs its
    blocks with that bias, so the last layer's distribution is the model's own next-token distribution."""
    loaded = load(factories.hf_t5_dir(tmp_path / "t5"))
    tok = loaded.tokenizer
    source = tok.encode("translate English to German: Good morning.")
    decoder_ids = [loaded.config.decoder_start_token_id, 5, 7, 9, 11]
    last = lens.n_layers(loaded) - 1  # the last block's output
    seen = lens.logit_lens(loaded, decoder_ids, [last], top_k=3, source_ids=source)[0]
    with torch.no_grad():
        logits = loaded.model(torch.tensor([source]), torch.tensor([len(source)]), torch.tensor([decoder_ids]))[0]
    probs, ids = torch.softmax(logits.float(), -1).topk(3, -1)
    assert seen.top_ids == ids.tolist()
    torch.testing.assert_close(torch.tensor(seen.top_probs), probs, atol=1e-5, rtol=1e-4)
