"""GGUF files of the Gemma 2 / Gemma 3 families (`model.gguf.families`), written by llama.cpp's own
`convert_hf_to_gguf.py` from the committed tiny trained fixtures: the model llama.cpp runs from the file, which is the
original with what the file cannot say read as llama.cpp reads it (the attention scale and Gemma 3's sliding
pattern are hard-coded there, not stored), gives the same logits, greedy tokens, tokenizer ids and chat prompts;
Q8_0 / Q4_0 copies of the file agree on the next token."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.gguf_files import llama_cpp_convert, llama_cpp_dir, rewrite_gguf
from tests.model.test_gguf import CHAT, TEXTS, _agreement, _assert_same_model
from tserve.model import checkpoint

FAMILIES = ("gemma3", "gemma2")


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families-hf")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def converted(originals, tmp_path_factory):
    """family -> the F32 file llama.cpp's converter writes from the committed fixture."""
    root = llama_cpp_dir(tmp_path_factory.mktemp("llama-cpp"))
    out = tmp_path_factory.mktemp("gguf-families")
    return {f: llama_cpp_convert(root, d, out / f"{f}.gguf") for f, d in originals.items()}


def _as_llama_cpp_reads(d, out):
    """The fixture with the two settings a GGUF file of its architecture cannot hold as llama.cpp reads them:
    scores scaled by 1 / sqrt(head size) (query_pre_attn_scalar: llama.cpp hard-codes it but for the 27B models) and
    Gemma 3's sliding pattern of five layers in six (both of the fixture's two layers slide)."""
    d = shutil.copytree(d, out)
    cfg = json.loads((d / "config.json").read_text())
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    if cfg["model_type"] == "gemma3_text":
        cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def references(originals, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families-ref")
    return {f: checkpoint.load(_as_llama_cpp_reads(d, root / f)) for f, d in originals.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_converted_file_is_the_model_llama_cpp_runs(family, converted, references):
    """Norms stored as 1 + w by the converter read back as w, Gemma's names of its four norms, the sliding window,
    soft caps (Gemma 2) and the local rope base and global linear rope scaling (Gemma 3): the same logits and greedy
    tokens as the safetensors checkpoint; its tokenizer's ids, chat prompt and eos list."""
    want, got = references[family], checkpoint.load(converted[family])
    for field in ("attention_scale", "attention_softcap", "logit_softcap", "sliding_window", "sliding_layers",
                  "rope_base", "rope_scaling", "local_rope_base", "local_rope_scaling", "qk_norm", "head_dim",
                  "norm_weight_offset", "sandwich_norms", "scale_embeddings", "tie_embeddings", "vocab_size"):
        assert getattr(got.config, field) == getattr(want.config, field), field
    _assert_same_model(want, got)
    for text in TEXTS:
        assert got.tokenizer.encode(text) == want.tokenizer.encode(text), text
    assert got.tokenizer.apply_chat_template(CHAT[:1]) == want.tokenizer.apply_chat_template(CHAT[:1])
    assert set(want.generation.eos_token_ids) <= set(got.generation.eos_token_ids)


def test_a_stored_sliding_pattern_wins(converted, originals, tmp_path):
    """`gemma3.attention.sliding_window_pattern` (one flag per layer), which llama.cpp reads before its
    hard-coded pattern: the committed fixture's own layer types (sliding, then global)."""
    file = rewrite_gguf(converted["gemma3"], tmp_path / "pattern.gguf",
                        metadata={"gemma3.attention.sliding_window_pattern": [True, False]})
    got, fixture = checkpoint.load(file), checkpoint.load(originals["gemma3"])
    assert got.config.sliding_layers == fixture.config.sliding_layers == [0]
    assert checkpoint.load(converted["gemma3"]).config.sliding_layers == [0, 1]


@pytest.mark.parametrize(("kind", "floor"), [("Q8_0", 0.95), ("Q4_0", 0.85)])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_quantized_files_agree_on_the_next_token(family, kind, floor, converted, references, tmp_path):
    """Every fixture's linear layers are rows of multiples of 32 (64 and 128 inputs): whole Q8_0 / Q4_0 blocks."""
    gguf = checkpoint.load(rewrite_gguf(converted[family], tmp_path / f"{kind}.gguf", kind), quantize="auto")
    assert gguf.quantization == {"Q8_0": "int8", "Q4_0": "int4"}[kind]
    assert _agreement(references[family], gguf, CYCLE_TEXT) >= floor
