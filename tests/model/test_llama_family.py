"""Llama-layout checkpoints (Llama, Mistral, Qwen2/3, SmolLM3, Gemma 2/3, Phi-3, Granite) against `transformers`
on the same trained weights (float32): logits, greedy tokens, tokenizers, chat templates, and the config layouts
and fields real checkpoints use."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from tests.helpers.factories import hf_family_dir
from tests.helpers.fixture_training import assert_varied, cycle_prompts
from tests.helpers.llama_family import FAMILIES
from tests.helpers.one_request import lm_tokens
from tserve.model.checkpoint import CheckpointError, load
from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.model.decoding import SamplingParams, generate

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

transformers = pytest.importorskip("transformers")

TEXTS = ["The quick brown fox", "Guten Morgen. Wo ist der Bahnhof?", "Töchter über König ☃ 🦊 naïve café",
         "  two  spaces\nand a newline", ""]


def _hf(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_logits_equal_transformers(hf_family):
    family, d = hf_family
    ours, hf = load(d), _hf(d)
    assert ours.source_format == f"hf-{json.loads((d / 'config.json').read_text())['model_type']}"
    assert ours.task == "text-generation"
    assert ours.config.kv_heads == 2 and ours.config.n_heads == 4
    # Past the llama fixture's original context (32), where its rope scaling changes the frequencies.
    tokens = torch.randint(0, ours.config.vocab_size, (3, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_served_models_compute_gate_and_fc1_as_one_product_with_the_same_outputs(hf_family):
    """Loaded to serve (packed or quantized), a gated MLP's two input projections are one linear layer; each
    output is the same dot product, so int8 logits (integer sums) are bit for bit those of the two layers."""
    from tserve.model.layers import MLP  # noqa: PLC0415
    from tserve.model.packed_linear import pack_linears  # noqa: PLC0415
    from tserve.model.quantize import quantize_int8, resolve_activations  # noqa: PLC0415

    _, d = hf_family
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    for quantize in ("none", "int8"):
        fused = load(d, quantize=quantize, pack_weights=True)
        mlps = [m for m in fused.model.modules() if isinstance(m, MLP)]
        assert mlps and all(m.gate is None and m.fc1 is None and m.gate_fc1 is not None for m in mlps)
        separate = load(d)
        if quantize == "int8":
            quantize_int8(separate.model, resolve_activations("auto"))
        else:
            pack_linears(separate.model)
        with torch.no_grad():
            ours, theirs = fused.model(tokens), separate.model(tokens)
        if quantize == "int8":
            assert torch.equal(ours, theirs)
        else:
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


# Greedy decoding against transformers' generate costs 1-4 s a family (more under load); `make test` runs it on the
# four whose positions and attention differ most (Llama 3's rope scaling, biased q/k/v, a sliding layer with a rope
# base of its own, LongRoPE with every layer sliding), CI on all nine. Every family's logits stay in `make test`
# (test_logits_equal_transformers).
GREEDY_IN_MAKE_TEST = ("llama", "qwen2", "gemma3", "phi3")


@pytest.mark.parametrize("hf_family", [pytest.param(f, id=f, marks=() if f in GREEDY_IN_MAKE_TEST else pytest.mark.slow)
                                       for f in FAMILIES], indirect=True)
def test_greedy_tokens_equal_transformers_generate(hf_family):
    family, d = hf_family
    ours, hf = load(d), _hf(d)
    runs = []
    for text in cycle_prompts(5, seed=7)[:3]:  # three: each is 40 greedy steps of transformers' and of ours
        prompt = ours.tokenizer.encode(text)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=40, pad_token_id=0)
        theirs = out[0, len(prompt):].tolist()
        got = lm_tokens(ours, prompt, SamplingParams(max_tokens=40, temperature=0.0))
        assert got == theirs, family
        runs.append(got)
    assert_varied(runs, min_distinct=1.0)
    # Batched (continuous batching's runner, prompts of different lengths) equals alone.
    prompts = [ours.tokenizer.encode(t) for t in cycle_prompts(6, seed=8)[:4]]
    batched = generate(ours, prompts, SamplingParams(max_tokens=20, temperature=0.0))
    assert [s.generated for s in batched] == [lm_tokens(ours, p, SamplingParams(max_tokens=20, temperature=0.0),
                                                        with_eos=False) for p in prompts]


def test_tokenizer_equals_transformers(hf_family):
    family, d = hf_family
    ours = load(d).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, (family, text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), (family, text)
    if family == "llama":  # its post-processor adds the bos
        assert ours.encode("x")[0] == ours.bos_id
    if family == "mistral":  # add_bos_token, and bytes for what the pieces lack
        assert ours.encode("x")[0] == ours.bos_id
        assert "<0xE2>" in theirs.convert_ids_to_tokens(ours.encode("☃"))


CHATS = [
    [{"role": "user", "content": "Hello world"}],
    [{"role": "system", "content": "Be brief. Ünïcode ✓"}, {"role": "user", "content": "Wo ist der Bahnhof?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hallo"},
     {"role": "user", "content": "  The quick brown fox  "}],
]


def test_chat_prompt_equals_apply_chat_template(hf_family):
    family, d = hf_family
    ours = load(d).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    chats = [c for c in CHATS if family != "mistral" or c[0]["role"] != "system"]
    for chat in chats:
        expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt = ours.apply_chat_template(chat)
        assert prompt == expected, family
        assert ours.encode(prompt, add_special_tokens=False) == theirs(expected, add_special_tokens=False).input_ids
    if family == "mistral":  # the template raises: its message comes back
        with pytest.raises(ValueError, match="Conversation roles must alternate"):
            ours.apply_chat_template([{"role": "assistant", "content": "x"}])
        # A template without a system role refuses a chat that has one, as transformers' rendering does.
        with pytest.raises(Exception) as refused:  # noqa: PT011 - jinja's TemplateError, whatever its module
            theirs.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
        with pytest.raises(ValueError) as ours_refused:
            ours.apply_chat_template(CHATS[1])
        assert str(refused.value) in str(ours_refused.value)
    if family.startswith("gemma"):  # no system role: the system message opens the first user turn
        assert "<start_of_turn>user\nBe brief. Ünïcode ✓\n\nWo ist der Bahnhof?<end_of_turn>" in ours.apply_chat_template(
            CHATS[1])
    if family.startswith("qwen"):  # loop controls and a tojson that keeps non-ASCII
        chat = [{"role": "user", "content": ""}, {"role": "user", "content": "x", "name": "Jürgen"}]
        assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False,
                                                                            add_generation_prompt=True)
        assert '"Jürgen"' in ours.apply_chat_template(chat)


def test_every_eos_id_stops(tmp_path):
    from tests.helpers.factories import hf_family_dir

    loaded = load(hf_family_dir("llama", tmp_path / "llama"))
    eos_ids = loaded.generation.eos_token_ids
    assert len(eos_ids) == 2
    prompt = loaded.tokenizer.encode("The quick brown fox")
    for eos in eos_ids:
        (seq,) = generate(loaded, [prompt], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}))
        assert seq.finish_reason == "stop" and seq.generated == [] and seq.next_token == eos


def test_sharded_bfloat16_checkpoint(tmp_path, hf_family):
    family, d = hf_family
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, sharded / f.name)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    ours = load(sharded)
    assert ours.dtype == torch.float32
    ref = _hf(sharded)  # the bfloat16 weights, in float32
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(tokens), ref(tokens).logits, atol=1e-4, rtol=1e-4)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../outside.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a .safetensors file in this directory"):
        load(sharded)


def test_classic_rope_layout_loads_the_same(tmp_path):
    from tests.helpers.factories import hf_family_dir

    d = hf_family_dir("llama", tmp_path / "llama")
    modern = load(d)
    raw = json.loads((d / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    (d / "config.json").write_text(json.dumps(raw))
    classic = load(d)
    assert classic.config.rope_scaling == modern.config.rope_scaling
    tokens = torch.randint(0, modern.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(classic.model(tokens), modern.model(tokens))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "needs"),
    ("hidden_act", "gelu", "hidden_act"),
    ("partial_rotary_factor", 1.5, "partial_rotary_factor"),
    ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0],
                      "original_max_position_embeddings": 32}, "differ in length"),
])
def test_unsupported_fields_are_named(tmp_path, field, value, message):
    from tests.helpers.factories import hf_family_dir

    d = hf_family_dir("qwen2", tmp_path / "qwen2")
    raw = json.loads((d / "config.json").read_text()) | {field: value}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        load(d)


@pytest.mark.slow  # 100 and 200 greedy steps of both models; rope-scaling-ignored is caught by the llama logits too
@pytest.mark.parametrize(("kind", "factor", "positions"), [("linear", 4.0, 100), ("dynamic", 2.0, 200)])
def test_linear_and_dynamic_rope_scaling_equal_transformers(tmp_path, kind, factor, positions):
    """Token-by-token decoding past the trained context, as transformers rotates it (model.rope)."""
    from tests.helpers.factories import hf_family_dir

    d = hf_family_dir("qwen3", tmp_path / "qwen3")
    raw = json.loads((d / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": kind, "rope_theta": 1e6, "factor": factor}
    (d / "config.json").write_text(json.dumps(raw))
    ours, hf = load(d), _hf(d)
    assert ours.config.max_seq_len == (128 * factor if kind == "dynamic" else 128)
    prompt = ours.tokenizer.encode("The quick brown fox")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=positions - len(prompt), min_new_tokens=positions - len(prompt),
                          pad_token_id=0)
    got = lm_tokens(ours, prompt, SamplingParams(max_tokens=positions - len(prompt), temperature=0.0, ignore_eos=True))
    assert got == out[0, len(prompt):].tolist()


def test_dynamic_rope_tables_are_transformers_for_each_sequence_length():
    """`dynamic` (NTK-aware) scaling without generating: within the trained context the default tables; at each
    later position p, the angles transformers' own `dynamic` rope gives a sequence of p + 1 tokens at p (what
    decoding token by token sees); not the linear ones, nor the default's."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tserve.model import rope

    trained, factor, base, d_head = 32, 3.0, 10000.0, 16
    scaling = {"rope_type": "dynamic", "factor": factor, "max_position_embeddings": trained}
    cos, sin = rope.tables(d_head, 96, base, scaling)
    cfg = LlamaConfig(hidden_size=4 * d_head, num_attention_heads=4, max_position_embeddings=trained,
                      rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": base})
    default_cos, _ = rope.tables(d_head, 96, base)
    assert torch.equal(cos[:trained], default_cos[:trained])
    for p in (trained, trained + 1, 50, 95):
        inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=p + 1)
        torch.testing.assert_close(cos[p], torch.cos(p * inv.float()), atol=1e-5, rtol=0)
        torch.testing.assert_close(sin[p], torch.sin(p * inv.float()), atol=1e-5, rtol=0)
        assert (cos[p] - default_cos[p]).abs().max() > 1e-3
    # The importer takes the trained context from the config's max_position_embeddings.
    from pathlib import Path

    from tserve.model.importers import llama

    raw = {"max_position_embeddings": trained, "rope_parameters": {"rope_type": "dynamic", "factor": factor}}
    assert llama.rope_settings(raw, Path("config.json"))[1] == scaling


@pytest.mark.parametrize("layer_types", [False, True])
def test_qwens_sliding_window_layers_equal_transformers(tmp_path, layer_types):
    """Qwen2's `use_sliding_window`: the layers from `max_window_layers` on slide (a config without `layer_types`,
    as older hub configs are), or those `layer_types` marks; logits equal transformers' past the window, and the
    window matters there."""
    d = hf_family_dir("qwen2", tmp_path / "qwen2")
    raw = json.loads((d / "config.json").read_text())
    raw |= {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}
    if layer_types:
        raw["layer_types"] = ["sliding_attention", "full_attention"]
    else:
        del raw["layer_types"]
    (d / "config.json").write_text(json.dumps(raw))
    ours, hf = load(d), _hf(d)
    assert (ours.config.sliding_window, ours.config.sliding_layers) == (12, [0] if layer_types else [1])
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.model(tokens)
        torch.testing.assert_close(got, hf(tokens).logits, atol=1e-4, rtol=1e-4)
        assert (got - load(hf_family_dir("qwen2", tmp_path / "plain")).model(tokens)).abs().max() > 1e-2


def test_gemma_ties_its_output_layer_unless_the_config_says_otherwise(tmp_path):
    """Gemma's configs default `tie_word_embeddings` to true: a config without the key ties the output layer to the
    embedding, as transformers builds it."""
    d = hf_family_dir("gemma2", tmp_path / "gemma2")
    raw = json.loads((d / "config.json").read_text())
    assert raw.pop("tie_word_embeddings", True) is True
    (d / "config.json").write_text(json.dumps(raw))
    ours, hf = load(d), _hf(d)
    assert ours.config.tie_embeddings and hf.config.tie_word_embeddings
    tokens = torch.randint(0, ours.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_longrope_past_the_original_context_equals_transformers(tmp_path):
    """Phi-3's LongRoPE with an original context of 32 (of 128): the short factors within it, the long ones and the
    attention factor past it, equal to transformers' model decoding greedily token by token with its cache; and
    the factors are not interchangeable. (transformers' `generate` for Phi-3 also throws its cache away once, when
    the text first passes the original context, and recomputes it all with the long factors: see model.rope.)"""
    from transformers import DynamicCache  # noqa: PLC0415

    d = hf_family_dir("phi3", tmp_path / "phi3")
    raw = json.loads((d / "config.json").read_text())
    raw["original_max_position_embeddings"] = 32
    raw["rope_parameters"] = raw["rope_parameters"] | {"original_max_position_embeddings": 32}
    (d / "config.json").write_text(json.dumps(raw))
    ours, hf = load(d), _hf(d)
    assert ours.config.rope_scaling["factor"] == 4.0 and ours.config.rotary_dim == 8
    prompt = ours.tokenizer.encode("The quick brown fox")
    n = 80 - len(prompt)
    theirs, cache, step = [], DynamicCache(config=hf.config), torch.tensor([prompt])
    with torch.no_grad():
        for position in range(len(prompt) - 1, 79):
            out = hf(step, cache=cache, use_cache=True,
                     position_ids=torch.arange(position + 1 - step.size(1), position + 1)[None])
            theirs.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[theirs[-1]]])
    assert lm_tokens(ours, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) == theirs
    assert_varied([theirs[i:i + 10] for i in range(0, n, 10)], 0.5)
    # The long factors past position 32 change what the model says there.
    raw["rope_parameters"] = raw["rope_parameters"] | {"long_factor": raw["rope_parameters"]["short_factor"]}
    (d / "config.json").write_text(json.dumps(raw))
    assert lm_tokens(load(d), prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) != theirs


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_sliding_window_decoding_in_the_paged_cache_equals_the_whole_forward(tmp_path, family):
    """Decoded 70 tokens past a short prompt, in a paged cache of scattered 4-position blocks (the CPU decode
    kernel reads a sliding layer's window through its table): each step's logits equal the uncached forward over
    the whole text, on both sides of the window (Gemma 3: 16 on its first layer; Phi-3: 48 on both). And the
    window matters: the same weights with a window wider than the text say otherwise past the window."""
    loaded = load(hf_family_dir(family, tmp_path / family))
    model, cfg = loaded.model, loaded.config
    tokens = loaded.tokenizer.encode("The quick brown")
    cache = model.new_cache(1, 128, num_blocks=40, block_size=4)
    cache.set_table(0, [b for b in range(39, 0, -1) if b != 20][:32])
    with torch.no_grad():
        logits = model.prefill(torch.tensor([tokens]), torch.tensor([len(tokens)]), cache, torch.tensor([0]))[0]
        while len(tokens) < 90:
            torch.testing.assert_close(logits, model(torch.tensor([tokens]))[0, -1], atol=1e-4, rtol=1e-4)
            tokens.append(int(logits.argmax()))
            logits = model.decode_step(torch.tensor([tokens[-1]]), torch.tensor([len(tokens) - 1]), cache,
                                       torch.tensor([0]), kv_len=len(tokens))[0]
        unwindowed = Decoder(replace(cfg, sliding_window=1000))  # wider than any text here
        unwindowed.load_state_dict(model.state_dict())
        full = model(torch.tensor([tokens]))
        assert torch.allclose(unwindowed(torch.tensor([tokens[:cfg.sliding_window]])), full[:, :cfg.sliding_window],
                              atol=1e-5)
        assert (unwindowed(torch.tensor([tokens])) - full).abs().max() > 1e-2


def test_gemma3_configs_as_the_hub_writes_them_and_its_multimodal_checkpoints_load_the_same(tmp_path):
    """The hub's Gemma 3 configs predate `rope_parameters` per layer type: rope_theta (global), rope_local_base_freq,
    rope_scaling (global only) and sliding_window_pattern. And a multimodal Gemma 3 (`gemma3`) nests the text
    config under text_config and its weights under model.language_model: its text model is the same model."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    d = hf_family_dir("gemma3", tmp_path / "gemma3")
    reference = load(d)
    raw = json.loads((d / "config.json").read_text())
    hub = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    hub |= {"rope_theta": 1e6, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "sliding_window_pattern": 2}
    (d / "config.json").write_text(json.dumps(hub))
    older = load(d)
    assert (older.config.sliding_layers, older.config.local_rope_base) == ([0], 10000.0)
    tokens = torch.randint(0, reference.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(older.model(tokens), reference.model(tokens))
    multimodal = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                  "eos_token_id": raw["eos_token_id"], "text_config": {k: v for k, v in raw.items() if "token_id" not in k},
                  "vision_config": {"model_type": "siglip_vision_model"}}
    (d / "config.json").write_text(json.dumps(multimodal))
    weights = {f"model.language_model.{k.removeprefix('model.')}": v for k, v in load_file(d / "model.safetensors").items()}
    weights["model.vision_tower.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(weights, d / "model.safetensors")
    text = load(d)
    assert text.source_format == "hf-gemma3" and text.generation.eos_token_ids == raw["eos_token_id"]
    with torch.no_grad():
        assert torch.equal(text.model(tokens), reference.model(tokens))


def test_grouped_query_cache_holds_kv_heads_only():
    """A Qwen2.5-0.5B-shaped attention (14 query heads, 2 kv heads) needs 1/7 of a full-heads cache."""
    shape = dict(vocab_size=64, d_model=112, n_heads=14, d_ff=64, n_layers=2, max_seq_len=32, positions="rope",
                 norm="rmsnorm", activation="swiglu", bias=False)
    grouped = Decoder(DecoderConfig(**shape, n_kv_heads=2)).new_cache(4)
    full = Decoder(DecoderConfig(**shape)).new_cache(4)
    assert grouped.k.size(2) == 2 and full.nbytes() == 7 * grouped.nbytes()


def test_generation_config_json_says_which_ids_end_a_sequence_where_config_json_disagrees(tmp_path):
    """As `transformers` reads a checkpoint: generation_config.json's eos_token_id (newer) over config.json's,
    and config.json's where no generation_config.json ships. Qwen2.5 ships both, and they disagree: config.json
    names <|endoftext|>, generation_config.json <|im_end|> and <|endoftext|>. Here they name different ids, so
    that an importer reading the wrong file stops where the checkpoint does not, or runs past its end."""
    from tests.helpers.factories import hf_family_dir

    d = hf_family_dir("qwen2", tmp_path / "qwen2")
    config = json.loads((d / "config.json").read_text())
    tok = load(d).tokenizer
    im_end, endoftext = (tok.encode(t, add_special_tokens=False)[0] for t in ("<|im_end|>", "<|endoftext|>"))
    (d / "config.json").write_text(json.dumps(config | {"eos_token_id": endoftext}))
    generation = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": [im_end]}))

    def ends_at(loaded, token: int) -> bool:
        prompt = loaded.tokenizer.encode("The quick brown fox")
        (seq,) = generate(loaded, [prompt], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={token: 100.0}))
        return seq.finish_reason == "stop"

    both = load(d)
    assert both.generation.eos_token_ids == [im_end]
    assert ends_at(both, im_end) and not ends_at(both, endoftext)
    reference = transformers.GenerationConfig.from_pretrained(d)
    assert reference.eos_token_id == [im_end]

    (d / "generation_config.json").unlink()
    config_only = load(d)
    assert config_only.generation.eos_token_ids == [endoftext]
    assert ends_at(config_only, endoftext) and not ends_at(config_only, im_end)


def test_a_short_rows_padding_past_the_window_leaves_no_nan_in_the_cache(tmp_path):
    """A batched prefill after a cached prefix: a row that starts at 16 with 2 new tokens, beside one of 45 from 0,
    is padded to positions 16..60, past the 45 keys by more than Gemma 2's window (16). Those padding queries still
    see keys (no NaN softmax written into the cache, where another row's masked read would pick it up), and the
    real rows' logits are those of each row alone."""
    loaded = load(hf_family_dir("gemma2", tmp_path / "gemma2"))
    model = loaded.model
    ids = loaded.tokenizer.encode(" ".join(cycle_prompts(4, seed=31)))[:45]
    assert len(ids) == 45
    cache = model.new_cache(2, 128, num_blocks=40, block_size=4)
    cache.set_tables([0, 1], [list(range(1, 17)), list(range(17, 33))])
    with torch.no_grad():
        model.prefill(torch.tensor([ids[:16]]), torch.tensor([16]), cache, torch.tensor([0]))
        batch = torch.tensor([ids[16:18] + [0] * 43, ids])
        logits = model.prefill(batch, torch.tensor([2, 45]), cache, torch.tensor([0, 1]), start=torch.tensor([16, 0]))
        assert not cache.k.isnan().any() and not cache.v.isnan().any()
        torch.testing.assert_close(logits[0], model(torch.tensor([ids[:18]]))[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[1], model(torch.tensor([ids]))[0, -1], atol=1e-4, rtol=1e-4)
