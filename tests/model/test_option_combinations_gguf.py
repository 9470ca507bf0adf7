"""GGUF files where an option or a metadata key leaves what the fixtures' files hold: end-of-generation ids of
every kind (eos, eot, and the control tokens that end a turn) on each family's file, `add_bos_token` absent from
the file, the pre-tokenizer names llama.cpp gives the same splits, `--quantize auto` on files whose tensors are of
several types or of the legacy 4/5-bit types, a custom `general.alignment`, per-layer metadata values, the rope of
Gemma's sliding layers, and a repo's GGUF file named by quantization in either case or by file at a revision. The
fixtures' own files (tests/model/test_gguf*.py) hold one type, one alignment and the keys the converter writes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.helpers import factories
from tests.helpers import gguf_files as gguf_writer
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.gguf_files import rewrite_gguf, write_gguf
from tests.model import test_hub
from tests.model.test_gguf import _agreement
from tests.model.test_gguf_families import _config, _meta
from tests.model.test_gguf_hub import gguf_repo  # noqa: F401  (the GGUF repo's files, a module fixture)
from tests.model.test_hub import MAIN, FakeHub, lay_out_cache
from tserve.model import checkpoint, hub
from tserve.model.gguf import GGUFCheckpoint
from tserve.model.gguf.header import read_header
from tserve.model.gguf.tokenizer import PRE_TOKENIZERS, gguf_tokenizer
from tserve.model.importers.base import CheckpointError

hf_env, tiny_qwen2 = test_hub.hf_env, test_hub.tiny_qwen2  # a fresh HF_HOME; the tiny Qwen2 the GGUF repo is of

FAMILIES = ("llama", "mistral", "qwen2", "gemma3")


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-options-hf")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def f32_files(originals, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-options")
    return {f: write_gguf(d, root / f"{f}.gguf", f) for f, d in originals.items()}


# ------------------------------------------------------------------------------------------------------------
# Tokenizer and end of generation from the metadata
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_file_ends_generation_wherever_its_original_does(family, originals, f32_files):
    """The file stores one eos id; the original's other end ids (Llama 3's <|end_of_text|>, Qwen's <|endoftext|>,
    Gemma's <end_of_turn>) are control tokens that end a turn, which the loaded model must stop at as well."""
    original, got = checkpoint.load(originals[family]), checkpoint.load(f32_files[family])
    want = set(original.generation.eos_token_ids or [original.tokenizer.eos_id])
    assert want <= set(got.generation.eos_token_ids), (want, got.generation.eos_token_ids)


def test_eot_and_eom_ids_of_the_metadata_end_generation(f32_files, tmp_path):
    """`tokenizer.ggml.eot_token_id` / `eom_token_id` name tokens that end generation as llama.cpp stops at them,
    even ordinary ones that are not in the list of turn-ending control tokens."""
    file = rewrite_gguf(f32_files["qwen2"], tmp_path / "eot.gguf",
                        metadata={"tokenizer.ggml.eot_token_id": 40, "tokenizer.ggml.eom_token_id": 41})
    ends = checkpoint.load(file).generation.eos_token_ids
    assert {40, 41} <= set(ends)
    assert 40 not in checkpoint.load(f32_files["qwen2"]).generation.eos_token_ids


@pytest.mark.parametrize(("family", "adds"), [("llama", False), ("mistral", True)])
def test_a_file_without_add_bos_token_follows_llama_cpps_default(family, adds, f32_files):
    """Older converters leave `tokenizer.ggml.add_bos_token` out: llama.cpp then adds bos for SentencePiece
    vocabularies (mistral) and not for byte-level BPE ones (llama), though both name a bos token."""
    meta = dict(read_header(f32_files[family]).metadata)
    assert meta.pop("tokenizer.ggml.add_bos_token") is True  # the file as written says add it
    tok = gguf_tokenizer(meta, f32_files[family])
    assert tok.bos_id is not None
    assert (tok.encode("hello there")[0] == tok.bos_id) is adds


# `tokenizer.ggml.pre` names llama.cpp reads as another's splits (`llama_vocab::impl::load`).
PRE_ALIASES = {"deepseek-r1-qwen": "qwen2", "llama3": "llama-bpe", "llama-v3": "llama-bpe", "smaug-bpe": "llama-bpe",
               "llama4": "gpt-4o", "starcoder": "smollm", "refact": "smollm", "default": "gpt-2"}
ALIAS_TEXTS = ["It's 1234567 o'clock, isn't it?!  ...\n\n  Cafe\u0301 \u00e9t\u00e9 12 345",
               "HelloWorld THEY'RE here x=1/2 .\n/usr/bin \t\t  \n\n 9876543210"]


def _words(tok, text: str) -> list[str]:
    backend = tok.backend
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
    return [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]


@pytest.mark.parametrize("alias", sorted(PRE_ALIASES))
def test_pre_tokenizer_aliases_split_as_the_pre_tokenizer_they_name(alias, f32_files):
    """DeepSeek-R1's Qwen distills say `deepseek-r1-qwen` (Qwen2's digits one by one and NFC), Llama 3 files
    `llama3` / `llama-v3` / `smaug-bpe`, ...: the same words and ids as the canonical name."""
    meta = dict(read_header(f32_files["qwen2"]).metadata)
    alias_tok = gguf_tokenizer(meta | {"tokenizer.ggml.pre": alias}, "f")
    canonical = gguf_tokenizer(meta | {"tokenizer.ggml.pre": PRE_ALIASES[alias]}, "f")
    for text in ALIAS_TEXTS:
        assert _words(alias_tok, text) == _words(canonical, text), text
        assert alias_tok.encode(text) == canonical.encode(text), text
    assert alias in PRE_TOKENIZERS


# ------------------------------------------------------------------------------------------------------------
# --quantize auto on files of several types, and of the legacy types
# ------------------------------------------------------------------------------------------------------------
def test_auto_takes_the_type_most_of_the_layers_have_not_the_embedding_and_output(originals, tmp_path):
    """A Q4_0 file whose v, o and down projections, embedding and output layer are Q8_0 (as llama.cpp's mixes
    keep the sensitive tensors wider): most of the layers' weights are Q4_0, so it is served as q4_0, though the
    embedding and output layer would tip a count over every 2-D tensor to Q8_0."""
    wide = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"} | {
        f"blk.{i}.{t}.weight": "Q8_0" for i in range(2) for t in ("attn_v", "attn_output", "ffn_down")}
    file = write_gguf(originals["llama"], tmp_path / "mix.gguf", "llama", "Q4_0", types=wide)
    types = GGUFCheckpoint(file).weights.weight_types()
    assert types["Q8_0"] > types["Q4_0"]  # over every 2-D tensor, Q8_0 has more
    loaded = checkpoint.load(file, quantize="auto")
    assert loaded.quantization == "q4_0"


@pytest.mark.parametrize(("kind", "served", "floor"), [("Q4_1", "int4", 0.85), ("Q5_0", "int8", 0.9),
                                                       ("Q5_1", "int8", 0.9)])
def test_legacy_block_types_are_dequantized_and_served_in_the_nearest_format(kind, served, floor, originals,
                                                                              tmp_path, monkeypatch):
    """Q4_1 / Q5_0 / Q5_1 files (older quantizations still on the hub): dequantized by the `gguf` library, served
    as int4 (4-bit) or int8 (5-bit: more than int4 keeps), agreeing with the float model on the next token."""
    monkeypatch.setitem(gguf_writer.TYPES, kind, gguf.GGMLQuantizationType[kind])
    file = write_gguf(originals["qwen2"], tmp_path / f"{kind}.gguf", "qwen2", kind)
    assert GGUFCheckpoint(file).weights.weight_types()[kind] > 0
    loaded = checkpoint.load(file, quantize="auto")
    assert loaded.quantization == served
    assert _agreement(checkpoint.load(originals["qwen2"]), loaded, CYCLE_TEXT) >= floor


# ------------------------------------------------------------------------------------------------------------
# The file's layout and metadata
# ------------------------------------------------------------------------------------------------------------
def _realigned(src, out, alignment: int):
    """A copy of `src` whose tensor data is aligned to `alignment` bytes (`general.alignment`), not 32."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    w.add_custom_alignment(alignment)
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.alignment"}
    for key, field in reader.fields.items():
        if key not in skip:
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(key, field.contents())
            else:
                w.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_a_custom_alignment_reads_the_same_tensors(kind, originals, tmp_path):
    """`general.alignment` 1024: the data starts at the next multiple of it after the header, and each tensor's
    offset from there; the same weights as the file with the default alignment, in floats and in blocks."""
    file = write_gguf(originals["qwen2"], tmp_path / "32.gguf", "qwen2", kind)
    aligned = _realigned(file, tmp_path / "1024.gguf", 1024)
    assert read_header(aligned).data_start % 1024 == 0 and read_header(aligned).metadata["general.alignment"] == 1024
    want, got = checkpoint.load(file, quantize="none"), checkpoint.load(aligned, quantize="none")
    for (name, a), (_, b) in zip(want.model.state_dict().items(), got.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_per_layer_metadata_is_one_value_only_where_every_layer_has_it():
    """Head counts stored per layer (a list): one value for every layer loads as that value; different values
    (layers of their own widths) are refused by name, not read as the first layer's."""
    same = _config(_meta("llama", 2, **{"attention.head_count_kv": [16, 16]}))
    assert same["num_key_value_heads"] == 16
    with pytest.raises(CheckpointError, match="head_count_kv differs between layers"):
        _config(_meta("llama", 2, **{"attention.head_count_kv": [16, 8]}))


def test_gemma_sliding_layers_rotate_as_llama_cpp_rotates_them():
    """Gemma 3 without `rope.freq_base_swa`: its sliding layers at llama.cpp's 10000, not the global base, and
    unscaled; Gemma 2 with it: at that base, scaled as the global layers are."""
    scaled = {"rope.freq_base": 1e6, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    gemma3 = _config(_meta("gemma3", 6, **scaled))["rope_parameters"]
    assert gemma3["sliding_attention"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert gemma3["full_attention"] == {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}
    gemma2 = _config(_meta("gemma2", 4, **scaled, **{"rope.freq_base_swa": 5e4}))["rope_parameters"]
    assert gemma2["sliding_attention"] == {"rope_theta": 5e4, "rope_type": "linear", "factor": 8.0}



def test_gemma_layers_slide_in_llama_cpps_pattern_when_the_file_stores_none():
    """A Gemma file without `attention.sliding_window_pattern` slides as llama.cpp's `set_swa_pattern(n)` does:
    the last layer of every 6 (Gemma 3) or 2 (Gemma 2) is global, the first ones slide; a stored count or list
    wins."""
    def kinds(arch, n, **meta):  # noqa: ANN001, ANN202
        return ["full" if t == "full_attention" else "slide" for t in _config(_meta(arch, n, **meta))["layer_types"]]

    assert kinds("gemma3", 8) == ["slide"] * 5 + ["full"] + ["slide"] * 2
    assert kinds("gemma2", 4) == ["slide", "full", "slide", "full"]
    assert kinds("gemma3", 4, **{"attention.sliding_window_pattern": 3}) == ["slide", "slide", "full", "slide"]
    stored = [True, False, False, True]
    assert kinds("gemma3", 4, **{"attention.sliding_window_pattern": stored}) == ["slide", "full", "full", "slide"]

# ------------------------------------------------------------------------------------------------------------
# A repo's GGUF file
# ------------------------------------------------------------------------------------------------------------
def test_a_quantization_named_in_lower_case_fetches_the_upper_case_file(hf_env, gguf_repo):  # noqa: F811
    """`ORG/REPO:q8_0` for a repo whose file says Q8_0 (and `:Q4_0` for one that says q4_0): found in any case,
    and only that file downloaded."""
    files = {p.name: p.read_bytes() for p in gguf_repo.iterdir()}
    fake = FakeHub({"org/tiny-qwen2-GGUF": files})
    try:
        hf_env(HF_ENDPOINT=fake.url)
        assert hub.resolve("org/tiny-qwen2-GGUF:q8_0").name == "tiny-qwen2-Q8_0.gguf"
        assert hub.resolve("org/tiny-qwen2-GGUF:Q4_0").name == "tiny-qwen2-q4_0.gguf"
        downloads = [p for p in fake.paths() if "/resolve/" in p]
        assert all(p.endswith(("tiny-qwen2-Q8_0.gguf", "tiny-qwen2-q4_0.gguf")) for p in downloads), downloads
    finally:
        fake.close()


def test_a_file_named_at_a_revision_is_that_revisions(hf_env, gguf_repo, tmp_path):  # noqa: F811
    """`ORG/REPO@REV:FILE.gguf`: the file of that revision (a tag or a commit), not main's."""
    hf_env(HF_HUB_OFFLINE="1")
    tag = "b" * 40
    snapshots = lay_out_cache(tmp_path / "hf-home" / "hub", "org/tiny-qwen2-GGUF", gguf_repo,
                              {"main": MAIN, "v1": tag})
    name = "tiny-qwen2-Q8_0.gguf"
    assert hub.resolve(f"org/tiny-qwen2-GGUF@v1:{name}") == snapshots["v1"] / name
    assert hub.resolve(f"org/tiny-qwen2-GGUF@{tag}:{name}") == snapshots["v1"] / name
    assert hub.resolve(f"org/tiny-qwen2-GGUF:{name}") == snapshots["main"] / name


def test_a_file_with_q_k_and_v_fused_keeps_their_biases(tmp_path):
    """A Llama with attention biases, converted by llama.cpp with `--fuse-qkv`: the file holds one `attn_qkv.bias`
    a layer, not `attn_q.bias`; the biases are still the model's (q, k, v and the output projection's), so its
    logits are the original's."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.helpers.gguf_files import llama_cpp_convert, llama_cpp_dir

    d = factories.hf_family_dir("llama", tmp_path / "biased")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"attention_bias": True}))
    weights, gen = load_file(d / "model.safetensors"), torch.Generator().manual_seed(0)
    for name, t in list(weights.items()):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            weights[name.replace(".weight", ".bias")] = 0.05 * torch.randn(t.shape[0], generator=gen)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    original = checkpoint.load(d)
    file = llama_cpp_convert(llama_cpp_dir(tmp_path / "llama-cpp"), d, tmp_path / "fused.gguf", "f32", "--fuse-qkv")
    assert "blk.0.attn_qkv.bias" in read_header(file).tensors
    loaded = checkpoint.load(file)
    assert loaded.config.qkv_bias
    ids = torch.tensor([original.tokenizer.encode(CYCLE_TEXT[:60])])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), original.model(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("stored", "asked"), [("Q8_0", "q4_0"), ("Q4_0", "q8_0")])
def test_a_block_format_named_is_the_one_served_from_a_file_of_the_other(stored, asked, originals, tmp_path):
    """`--quantize q4_0` on a Q8_0 file serves Q4_0 layers (what was asked, for its memory), the output layer Q8_0
    as `q4_0` keeps it; `q8_0` on a Q4_0 file serves Q8_0. `auto` serves the file's own blocks as they are."""
    from tserve.model.block_quant import BlockLinear
    from tserve.model.quantize import OUTPUT_LAYER

    file = write_gguf(originals["llama"], tmp_path / f"{stored}.gguf", "llama", stored)

    def formats(loaded) -> tuple[set[str], str]:  # noqa: ANN001 - the layers' formats, the output layer's
        head = getattr(loaded.model, OUTPUT_LAYER)
        return {m.fmt for m in loaded.model.modules() if isinstance(m, BlockLinear) and m is not head}, head.fmt

    named = checkpoint.load(file, quantize=asked, pack_weights=True)
    assert named.quantization == asked and formats(named) == ({asked}, "q8_0")
    as_is = checkpoint.load(file, quantize="auto", pack_weights=True)
    assert as_is.quantization == stored.lower() and formats(as_is)[0] == {stored.lower()}
