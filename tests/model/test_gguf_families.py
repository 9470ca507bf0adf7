"""GGUF files of the Gemma 2 / Gemma 3, Phi-3 and Granite families (`model.gguf.families`), written by llama.cpp's
own `convert_hf_to_gguf.py` from the committed tiny trained fixtures: the model llama.cpp runs from the file (for
Gemma, the original with what the file cannot say read as llama.cpp reads it: the attention scale and Gemma 3's
sliding pattern are hard-coded there, not stored) gives the same logits, greedy tokens, tokenizer ids and chat
prompts; Q8_0 / Q4_0 copies of the file agree on the next token. The same from the tests' own writer
(`gguf_files.write_gguf`, no llama.cpp needed), and what llama.cpp hard-codes from metadata alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.gguf_files import llama_cpp_convert, llama_cpp_dir, rewrite_gguf, write_gguf
from tests.model.test_gguf import CHAT, TEXTS, _agreement, _assert_same_model
from tserve.model import checkpoint

FAMILIES = ("gemma3", "gemma2", "phi3", "granite")


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families-hf")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def llama_cpp_root(tmp_path_factory):
    return llama_cpp_dir(tmp_path_factory.mktemp("llama-cpp"))


@pytest.fixture(scope="module")
def converted(originals, llama_cpp_root, tmp_path_factory):
    """family -> the F32 file llama.cpp's converter writes from the committed fixture."""
    root = llama_cpp_root
    out = tmp_path_factory.mktemp("gguf-families")
    return {f: llama_cpp_convert(root, d, out / f"{f}.gguf") for f, d in originals.items()}


def _as_llama_cpp_reads(d, out, pattern_stored: bool = False):
    """The fixture with the two settings a GGUF file of its architecture cannot hold as llama.cpp reads them:
    scores scaled by 1 / sqrt(head size) (query_pre_attn_scalar: llama.cpp hard-codes it but for the 27B models) and
    Gemma 3's sliding pattern of five layers in six (both of the fixture's two layers slide)."""
    d = shutil.copytree(d, out)
    cfg = json.loads((d / "config.json").read_text())
    if not cfg["model_type"].startswith("gemma"):
        return d
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    if cfg["model_type"] == "gemma3_text" and not pattern_stored:
        cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def references(originals, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families-ref")
    return {f: checkpoint.load(_as_llama_cpp_reads(d, root / f)) for f, d in originals.items()}


@pytest.mark.slow  # llama.cpp's converter on four fixtures: CI's `make test SLOW=1`
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_converted_file_is_the_model_llama_cpp_runs(family, converted, references):
    """Gemma: norms stored as 1 + w by the converter read back as w, the names of its four norms, the sliding
    window, soft caps (Gemma 2), the local rope base and global linear rope scaling (Gemma 3). Phi-3: the fused qkv
    and gate_up projections, LongRoPE's long and short factors, half of each head rotated, the window of every
    layer. Granite: its four multipliers. The same logits and greedy tokens as the safetensors checkpoint; its
    tokenizer's ids, chat prompt and eos list."""
    want, got = references[family], checkpoint.load(converted[family])
    for field in ("attention_scale", "attention_softcap", "logit_softcap", "sliding_window", "sliding_layers",
                  "rope_base", "rope_scaling", "local_rope_base", "local_rope_scaling", "rotary_dim", "qk_norm",
                  "head_dim", "norm_weight_offset", "sandwich_norms", "scale_embeddings", "embedding_multiplier",
                  "residual_multiplier", "logits_divisor", "tie_embeddings", "vocab_size"):
        value, expected = getattr(got.config, field), getattr(want.config, field)
        if field == "rope_scaling" and expected is not None:  # the file's attention factor: transformers' own
            value = {k: v for k, v in value.items() if k != "attention_factor"}
        assert value == (pytest.approx(expected, rel=1e-6) if isinstance(expected, float) else expected), field
    _assert_same_model(want, got)
    for text in TEXTS:
        assert got.tokenizer.encode(text) == want.tokenizer.encode(text), text
    assert got.tokenizer.apply_chat_template(CHAT[:1]) == want.tokenizer.apply_chat_template(CHAT[:1])
    assert set(want.generation.eos_token_ids) <= set(got.generation.eos_token_ids)


@pytest.mark.slow  # llama.cpp's converter on four fixtures: CI's `make test SLOW=1`
def test_a_stored_sliding_pattern_wins(converted, originals, tmp_path):
    """`gemma3.attention.sliding_window_pattern` (one flag per layer), which llama.cpp reads before its
    hard-coded pattern: the committed fixture's own layer types (sliding, then global)."""
    file = rewrite_gguf(converted["gemma3"], tmp_path / "pattern.gguf",
                        metadata={"gemma3.attention.sliding_window_pattern": [True, False]})
    got, fixture = checkpoint.load(file), checkpoint.load(originals["gemma3"])
    assert got.config.sliding_layers == fixture.config.sliding_layers == [0]
    assert checkpoint.load(converted["gemma3"]).config.sliding_layers == [0, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_files_of_the_test_writer_are_the_model_llama_cpp_runs(family, originals, tmp_path):
    """The same from the `gguf` library's writer as llama.cpp's converter writes these families (no llama.cpp
    needed), with Gemma's sliding pattern stored (`attention.sliding_window_pattern`); Q8_0 / Q4_0 files of it agree
    on the next token."""
    want = checkpoint.load(_as_llama_cpp_reads(originals[family], tmp_path / "ref", pattern_stored=True))
    _assert_same_model(want, checkpoint.load(write_gguf(originals[family], tmp_path / "f32.gguf", family)))
    for kind, floor in (("Q8_0", 0.95), ("Q4_0", 0.85)):
        file = write_gguf(originals[family], tmp_path / f"{kind}.gguf", family, kind)
        assert _agreement(want, checkpoint.load(file, quantize="auto"), CYCLE_TEXT) >= floor, kind


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_q_k_v_fused_by_the_converter_are_split_again(family, llama_cpp_root, tmp_path):
    """`convert_hf_to_gguf.py --fuse-qkv` stores one `attn_qkv` per layer (weights and, for Qwen2, biases), after
    the q/k row reordering of the `llama` architecture: read as the original's q, k and v projections."""
    original = checkpoint.load(factories.hf_family_dir(family, tmp_path / family))
    file = llama_cpp_convert(llama_cpp_root, original.path, tmp_path / "fused.gguf", "f32", "--fuse-qkv")
    from tserve.model.gguf.header import read_header

    names = read_header(file).tensors
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    assert ("blk.0.attn_qkv.bias" in names) == (family == "qwen2")
    _assert_same_model(original, checkpoint.load(file))


@pytest.mark.slow  # llama.cpp's converter on four fixtures: CI's `make test SLOW=1`
@pytest.mark.parametrize(("kind", "floor"), [("Q8_0", 0.95), ("Q4_0", 0.85)])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_quantized_files_agree_on_the_next_token(family, kind, floor, converted, references, tmp_path):
    """Every fixture's linear layers are rows of multiples of 32 (64 and 128 inputs): whole Q8_0 / Q4_0 blocks."""
    gguf = checkpoint.load(rewrite_gguf(converted[family], tmp_path / f"{kind}.gguf", kind), quantize="auto")
    assert gguf.quantization == {"Q8_0": "q8_0", "Q4_0": "q4_0"}[kind]  # the file's own blocks
    assert _agreement(references[family], gguf, CYCLE_TEXT) >= floor


# ------------------------------------------------------------------------------------------------------------
# Metadata alone: what llama.cpp hard-codes, partial rotary, refusals
# ------------------------------------------------------------------------------------------------------------
def _meta(arch: str, layers: int, **extra) -> dict:
    return {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": 4608,
            f"{arch}.attention.head_count": 32, f"{arch}.attention.head_count_kv": 16,
            f"{arch}.attention.key_length": 128, f"{arch}.feed_forward_length": 36864, f"{arch}.context_length": 8192,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens": ["a"] * 8} | {
            f"{arch}.{k}": v for k, v in extra.items()}


def _config(meta: dict) -> dict:
    from tserve.model.gguf.families import hf_config

    return hf_config(meta, {}, "f.gguf", {})


@pytest.mark.parametrize(("arch", "layers", "scalar"), [("gemma2", 46, 144), ("gemma2", 42, 128),
                                                        ("gemma3", 62, 144), ("gemma3", 34, 128)])
def test_gemma_attention_scale_is_llama_cpps(arch, layers, scalar):
    """1 / sqrt(hidden / heads) for the 27B models (46 / 62 layers, Gemma 2's query_pre_attn_scalar 144), else
    1 / sqrt(head size): as llama.cpp scales whatever the original said."""
    assert _config(_meta(arch, layers))["query_pre_attn_scalar"] == scalar


def test_gemma_sliding_layers_and_window_as_llama_cpp_reads_them():
    sliding = [i for i, t in enumerate(_config(_meta("gemma3", 12, **{"attention.sliding_window": 512}))["layer_types"])
               if t == "sliding_attention"]
    assert sliding == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]  # five in six, the sixth global
    assert _config(_meta("gemma3", 12))["sliding_window"] is None  # Gemma 3 without a window: none
    gemma2 = _config(_meta("gemma2", 4))
    assert (gemma2["sliding_window"], gemma2["layer_types"][:2]) == (4096, ["sliding_attention", "full_attention"])
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    every = _config(_meta("gemma2", 4, **{"attention.sliding_window_pattern": 0}))["layer_types"]
    assert every == ["sliding_attention"] * 4  # llama.cpp's pattern 0: every layer slides


def test_partial_rotary_except_where_the_converter_reordered_whole_heads():
    from tserve.model.importers.base import CheckpointError

    assert _config(_meta("phi3", 32, **{"rope.dimension_count": 96}))["partial_rotary_factor"] == 0.75
    with pytest.raises(CheckpointError, match="over the whole head of the llama architecture"):
        _config(_meta("llama", 32, **{"rope.dimension_count": 96}))


def test_granite_multipliers_and_a_file_without_rotary_positions():
    from tserve.model.importers.base import CheckpointError

    cfg = _config(_meta("granite", 40, embedding_scale=12.0, residual_scale=0.22, logit_scale=8.0,
                        **{"attention.scale": 0.0078125}))
    assert (cfg["embedding_multiplier"], cfg["attention_multiplier"], cfg["logits_scaling"]) == (12.0, 0.0078125, 8.0)
    assert cfg["residual_multiplier"] == 0.22
    with pytest.raises(CheckpointError, match="no rotary positions"):
        _config(_meta("granite", 40, **{"rope.scaling.finetuned": False}))


def test_longrope_needs_both_factor_tensors():
    from tserve.model.gguf.families import hf_config
    from tserve.model.importers.base import CheckpointError

    meta = _meta("phi3", 32, **{"rope.scaling.original_context_length": 4096})
    with pytest.raises(CheckpointError, match="rope_factors_short"):
        hf_config(meta, {}, "f.gguf", {"rope_factors_long.weight": np.ones(64)})
    got = hf_config(meta, {}, "f.gguf", {"rope_factors_long.weight": np.full(64, 2.0),
                                         "rope_factors_short.weight": np.ones(64)})["rope_scaling"]
    assert (got["long_factor"][0], got["short_factor"][0], got["factor"]) == (2.0, 1.0, 2.0)
