"""GGUF files as checkpoints (`model.gguf`): the committed tiny Llama (Llama 3 tokenizer and rope scaling),
Mistral (SentencePiece), Qwen2 and Qwen3 written as GGUF F32 / Q8_0 / Q4_0 by the `gguf` library's writer as
llama.cpp's converter writes them, and Llama and Qwen2 converted by llama.cpp's own `convert_hf_to_gguf.py`:
F32 gives the safetensors original's logits and greedy tokens, the tokenizer its ids and chat prompts, block
quantizations agree on the next token (served as tserve's int8 / int4); hostile files are refused with the
reason before anything is allocated."""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT, assert_varied, cycle_prompts
from tests.helpers.gguf_files import gguf_string, header, llama_cpp_convert, llama_cpp_dir, write_gguf
from tests.helpers.one_request import lm_tokens
from tserve.model import checkpoint
from tserve.model.checkpoint import CheckpointError
from tserve.model.decoding import SamplingParams
from tserve.model.gguf import families, tensors
from tserve.model.gguf.header import TensorInfo

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Guten Morgen. Wo ist der Bahnhof? Ich weiß es nicht.",
         "  two  spaces, tabs\tand\nnew lines 12345 ünïcödé ✓", "<|im_start|>user\nhello<|im_end|>", ""]
CHAT = [{"role": "user", "content": "Where is the station?"}, {"role": "assistant", "content": "I don't know."},
        {"role": "user", "content": "Good morning."}]


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-hf")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def gguf_files(originals, tmp_path_factory):
    """family -> kind -> file."""
    root = tmp_path_factory.mktemp("gguf")
    return {f: {k: write_gguf(d, root / f"{f}-{k}.gguf", f, k) for k in ("F32", "Q8_0", "Q4_0")}
            for f, d in originals.items()}


@pytest.fixture(scope="module")
def loaded_originals(originals):
    return {f: checkpoint.load(d) for f, d in originals.items()}


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor([ids]))[0]


def _assert_same_model(original, gguf) -> None:
    ids = original.tokenizer.encode(CYCLE_TEXT[:200])
    torch.testing.assert_close(_logits(gguf, ids), _logits(original, ids), rtol=1e-5, atol=1e-5)
    prompts = [original.tokenizer.encode(p) for p in cycle_prompts(4, seed=3)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [lm_tokens(original, p, params) for p in prompts]
    assert [lm_tokens(gguf, p, params) for p in prompts] == want
    assert_varied(want, min_distinct=0.75)


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_file_is_the_original(family, gguf_files, loaded_originals):
    """Same config, logits and greedy tokens as the safetensors checkpoint it was written from (q/k rows of the
    `llama` architecture put back in Hugging Face's order; Llama 3's rope scaling read back from rope_freqs)."""
    original, gguf = loaded_originals[family], checkpoint.load(gguf_files[family]["F32"])
    assert gguf.source_format == f"gguf-{'llama' if family == 'mistral' else family}"
    for field in ("d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "n_layers", "rope_base", "rope_scaling",
                  "tie_embeddings", "qkv_bias", "qk_norm", "vocab_size"):
        assert getattr(gguf.config, field) == getattr(original.config, field), field
    _assert_same_model(original, gguf)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_half_precision_files_are_the_original_rounded(kind, originals, loaded_originals, tmp_path):
    """F16 / BF16 weights load as they are: the original's next tokens, logits within the rounding."""
    original = loaded_originals["llama"]
    gguf = checkpoint.load(write_gguf(originals["llama"], tmp_path / "half.gguf", "llama", kind))
    assert gguf.quantization == "none"
    ids = original.tokenizer.encode(CYCLE_TEXT)[: original.config.max_seq_len]
    want, got = _logits(original, ids), _logits(gguf, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 if kind == "F16" else 0.3)
    assert not torch.equal(got, want)  # rounded: the file's own weights, not the original's
    assert _agreement(original, gguf, CYCLE_TEXT) >= 0.97


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_is_the_original(family, gguf_files, loaded_originals):
    """The GGUF vocabulary (byte-level BPE with merges, or SentencePiece with scores), its special tokens and chat
    template give the original tokenizer's ids, text and chat prompts."""
    want, got = loaded_originals[family].tokenizer, checkpoint.load(gguf_files[family]["F32"]).tokenizer
    for text in TEXTS:
        assert got.encode(text) == want.encode(text), text
        assert got.decode(want.encode(text)) == want.decode(want.encode(text))
    assert (got.bos_id, got.eos_id, got.vocab_size) == (want.bos_id, want.eos_id, want.vocab_size)
    if family != "mistral":  # its template raises on a system turn only: same messages either way
        assert got.apply_chat_template(CHAT) == want.apply_chat_template(CHAT)
    assert got.chat_template == want.chat_template


# The pre-tokenizers of Llama 3's, Qwen2's and SmolLM's tokenizer.json, as their releases ship them.
_SPLIT = {"type": "Split", "behavior": "Isolated", "invert": False}
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RELEASED_PRE_TOKENIZERS = {  # name: (normalizer, pre-tokenizers, ignore_merges)
    "llama-bpe": (None, [_SPLIT | {"pattern": {"Regex": _LLAMA3}}, _BYTES], True),
    "qwen2": ({"type": "NFC"}, [_SPLIT | {"pattern": {"Regex": _QWEN2}}, _BYTES], False),
    "smollm": (None, [{"type": "Digits", "individual_digits": True}, _BYTES | {"use_regex": True}], False),
}
RELEASED_PRE_TOKENIZERS["refact"] = RELEASED_PRE_TOKENIZERS["smollm"]  # StarCoder's tokenizer.json, as SmolLM's
# tiktoken's o200k_base `pat_str` (tiktoken_ext/openai_public.py), as it builds it: Phi-4-mini's tokenizer.json splits
# with it, then maps bytes (no normalizer; merges applied to every word).
_O200K = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
RELEASED_PRE_TOKENIZERS["gpt-4o"] = (None, [_SPLIT | {"pattern": {"Regex": _O200K}}, _BYTES], False)


@pytest.mark.parametrize("pre", sorted(RELEASED_PRE_TOKENIZERS))
def test_named_pre_tokenizers_split_as_the_released_tokenizers(pre, originals, tmp_path):
    """`tokenizer.ggml.pre` llama-bpe / qwen2 / smollm / gpt-4o: the tiny vocabulary behind the pre-tokenizer (and
    normalizer, BPE flags) of Llama 3's / Qwen2's / SmolLM's / o200k's (Phi-4-mini's) tokenizer.json gives the same
    ids from its GGUF file (digits split in threes or one by one, contractions, case runs, CJK, spaces before
    punctuation, whitespace runs, decomposed accents)."""
    import json
    import shutil

    from tserve.model.tokenizer import load_tokenizer

    normalizer, pieces, ignore_merges = RELEASED_PRE_TOKENIZERS[pre]
    d = shutil.copytree(originals["qwen2"], tmp_path / "original")
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["normalizer"] = normalizer
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": pieces}
    tj["model"]["ignore_merges"] = ignore_merges
    (d / "tokenizer.json").write_text(json.dumps(tj))
    want = load_tokenizer(d)
    got = checkpoint.load(write_gguf(d, tmp_path / "t.gguf", "qwen2", pre=pre)).tokenizer
    texts = [*TEXTS, "It's 1234567 o'clock, isn't it?!  ...\n\n  Cafe\u0301 \u00e9t\u00e9 12 345",
             "HelloWorld THEY'RE here, I'M SURE; don'T \u4f60\u597d\u4e16\u754c\u3002\u30c6\u30b9\u30c8 "
             "\ud55c\uad6d\uc5b4 x=1/2 .\n/usr/bin \t\t  \n\n 9876543210"]
    for text in texts:
        assert got.encode(text) == want.encode(text), text
    # The words BPE sees are the released tokenizer's, which the default (GPT-2's) splits otherwise: the
    # tiny vocabulary has too few merges for every difference to show in the ids.
    default = checkpoint.load(write_gguf(d, tmp_path / "gpt2.gguf", "qwen2")).tokenizer

    def words(tok, text):
        backend = tok.backend
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
        return [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]

    assert [words(got, t) for t in texts] == [words(want, t) for t in texts]
    assert [words(default, t) for t in texts] != [words(want, t) for t in texts]


def test_sentencepiece_without_a_space_prefix(originals, tmp_path):
    """`tokenizer.ggml.add_space_prefix` false: no space in front of the text, as the tokenizer.json says, and
    none taken off a text that begins with one when decoding (the original then has no Strip decoder)."""
    import json
    import shutil

    from tserve.model.tokenizer import load_tokenizer

    d = shutil.copytree(originals["mistral"], tmp_path / "original")
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["prepend_scheme"] = "never"
    tj["decoder"]["decoders"] = [step for step in tj["decoder"]["decoders"] if step["type"] != "Strip"]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    want = load_tokenizer(d)
    got = checkpoint.load(write_gguf(d, tmp_path / "t.gguf", "mistral")).tokenizer
    texts = [*TEXTS, " Hello world", "  two spaces first"]
    assert [got.encode(t) for t in texts] == [want.encode(t) for t in texts]
    assert [got.decode(want.encode(t)) for t in texts] == [want.decode(want.encode(t)) for t in texts]
    assert want.decode(want.encode(" Hello world")) == " Hello world"  # the decoder's case is reached
    assert want.encode("Hello") != load_tokenizer(originals["mistral"]).encode("Hello")  # the flag matters


def _agreement(original, quantized, text: str) -> float:
    ids = original.tokenizer.encode(text)[: original.config.max_seq_len]
    return (_logits(quantized, ids).argmax(-1) == _logits(original, ids).argmax(-1)).float().mean().item()


@pytest.mark.parametrize(("kind", "served", "floor"), [("Q8_0", "q8_0", 0.95), ("Q4_0", "q4_0", 0.85)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_block_quantized_files_are_served_in_our_formats(family, kind, served, floor, gguf_files, loaded_originals,
                                                         caplog):
    """Q8_0 / Q4_0 files (quantize="auto", the default) served on llama.cpp's blocks, q8_0 / q4_0, which the log
    says (the blocks' own codes: test_gguf_blocks); teacher-forced next tokens agree with the float model's."""
    with caplog.at_level(logging.INFO, logger="tserve.model.checkpoint"):
        gguf = checkpoint.load(gguf_files[family][kind], quantize="auto")
    assert gguf.quantization == served
    said = [r for r in caplog.records if "blocks served as they are" in r.getMessage()]
    assert said and said[0].quantization == served and kind in said[0].gguf_types
    assert _agreement(loaded_originals[family], gguf, CYCLE_TEXT) >= floor
    # `--quantize none`: the dequantized floats themselves, as close.
    floats = checkpoint.load(gguf_files[family][kind], quantize="none")
    assert floats.quantization == "none" and _agreement(loaded_originals[family], floats, CYCLE_TEXT) >= floor


def test_an_explicit_quantization_wins_and_auto_keeps_floats_where_ours_cannot_run(gguf_files, caplog):
    file = gguf_files["qwen2"]["Q8_0"]
    assert checkpoint.load(file, quantize="int4").quantization == "int4"
    with caplog.at_level(logging.INFO, logger="tserve.model.checkpoint"):
        bf16 = checkpoint.load(file, dtype="bfloat16", quantize="auto")
    assert (bf16.quantization, bf16.dtype) == ("none", torch.bfloat16)
    said = next(r for r in caplog.records if "GGUF block-quantized" in r.getMessage())
    assert said.nearest == "q8_0" and said.quantization == "none" and "float32 on the CPU" in said.why
    assert checkpoint.load(gguf_files["qwen2"]["F32"], quantize="auto").quantization == "none"


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_block_dequantization_is_the_reference(kind):
    """Our Q8_0 / Q4_0 dequantization equals the gguf library's on random blocks (every scale is its own
    block's: a scale read from the neighbouring block fails this)."""
    from gguf import GGMLQuantizationType, quants

    weights = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    weights *= np.linspace(0.1, 10, 24).repeat(32).reshape(8, 96)  # every block of its own scale
    blocks = quants.quantize(weights, GGMLQuantizationType[kind])
    info = TensorInfo("w", (96, 8), GGMLQuantizationType[kind], 0, blocks.nbytes)
    got = tensors.to_float(blocks, info)
    want = quants.dequantize(blocks, GGMLQuantizationType[kind])
    np.testing.assert_array_equal(got.numpy(), want)


def test_k_quants_are_dequantized_by_the_library(tmp_path):
    """A Q6_K / Q4_K tensor (which only llama.cpp's quantizer writes) reads as the gguf library dequantizes it, in
    PyTorch's shape; such a file is served as the nearest of our formats."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    rng = np.random.default_rng(1)
    for kind in (GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_K):
        block, size = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (3, 2 * size), dtype=np.uint8)
        raw.reshape(3, 2, size)[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
        if kind == GGMLQuantizationType.Q6_K:
            raw.reshape(3, 2, size)[..., -2:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        info = TensorInfo("w", (2 * block, 3), kind, 0, raw.nbytes)
        got = tensors.to_float(raw, info)
        assert got.shape == (3, 2 * block)
        np.testing.assert_array_equal(got.numpy(), quants.dequantize(raw, kind))
    assert tensors.NEAREST_QUANTIZATION[GGMLQuantizationType.Q6_K] == "int8"
    assert tensors.NEAREST_QUANTIZATION[GGMLQuantizationType.Q4_K] == "int4"


def test_unpermute_undoes_llama_cpp_permute():
    from tests.helpers.gguf_files import permute

    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    for heads, kv in ((8, 8), (8, 2)):
        rows = w[: kv * 16] if kv != heads else w
        assert torch.equal(families.unpermute_qk(torch.from_numpy(permute(rows.numpy(), heads, kv)), kv), rows)


def test_a_llama_file_with_attention_and_mlp_biases_is_the_original(originals, tmp_path):
    """`attention_bias` / `mlp_bias` of the `llama` architecture (as InternLM-style checkpoints have): the q and k
    biases, reordered by the converter as their rows were, put back with them; o, gate, up and down biases as they
    are. A value length other than the key length is refused by name."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    d = shutil.copytree(originals["llama"], tmp_path / "biased")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"attention_bias": True, "mlp_bias": True}))
    weights = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, w in list(weights.items()):
        if name.endswith(("_proj.weight",)):  # every projection: q, k, v, o, gate, up, down
            weights[name.replace(".weight", ".bias")] = 0.05 * torch.randn(w.shape[0], generator=g)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    original = checkpoint.load(d)
    assert original.config.qkv_bias and original.config.out_bias and original.config.mlp_bias
    gguf = checkpoint.load(write_gguf(d, tmp_path / "biased.gguf", "llama"))
    assert (gguf.config.qkv_bias, gguf.config.out_bias, gguf.config.mlp_bias) == (True, True, True)
    _assert_same_model(original, gguf)

    from tests.helpers.gguf_files import rewrite_gguf

    longer = rewrite_gguf(tmp_path / "biased.gguf", tmp_path / "v.gguf",
                          metadata={"llama.attention.value_length": 2 * original.config.head_dim})
    with pytest.raises(CheckpointError, match="value_length differs from key_length"):
        checkpoint.load(longer)


# ------------------------------------------------------------------------------------------------------------
# llama.cpp's own converter
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_cpp_root(tmp_path_factory):
    return llama_cpp_dir(tmp_path_factory.mktemp("llama-cpp"))


@pytest.mark.slow  # llama.cpp's converter: CI's `make test SLOW=1`
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpp_converted_file_is_the_original(family, llama_cpp_root, originals, loaded_originals, tmp_path):
    """A file written by llama.cpp's convert_hf_to_gguf.py (f32): the original's logits, greedy tokens and
    tokenizer ids, its eos list included."""
    file = llama_cpp_convert(llama_cpp_root, originals[family], tmp_path / f"{family}.gguf")
    original, gguf = loaded_originals[family], checkpoint.load(file)
    _assert_same_model(original, gguf)
    assert all(gguf.tokenizer.encode(t) == original.tokenizer.encode(t) for t in TEXTS)
    assert set(original.generation.eos_token_ids or [original.tokenizer.eos_id]) <= set(gguf.generation.eos_token_ids)


# ------------------------------------------------------------------------------------------------------------
# Hostile files
# ------------------------------------------------------------------------------------------------------------
def _kv(key: str, value: int) -> bytes:
    return gguf_string(key) + struct.pack("<IQ", 10, value)  # u64


def _tensor_info(name: str, dims: tuple[int, ...], kind: int, offset: int) -> bytes:
    return gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack(
        "<IQ", kind, offset)


HOSTILE = {
    "bad magic": (b"GGML" + bytes(40), "not the magic"),
    "old version": (header(0, 0, version=1) + bytes(16), "GGUF version 1"),
    "absurd tensor count": (header(2**62, 0) + bytes(64), "tensors declared, more than a file"),
    "absurd metadata count": (header(0, 2**60) + bytes(64), "metadata entries declared"),
    "huge string length": (header(0, 1) + gguf_string("general.name") + struct.pack("<IQ", 8, 2**61) + b"x",
                           "needs 2,305,843,009,213,693,952 bytes"),
    "huge array": (header(0, 1) + gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**40),
                   "1,099,511,627,776 elements"),
    "offset past the end": (header(1, 0) + _tensor_info("token_embd.weight", (32, 4), 0, 1 << 40) + bytes(64),
                            "ends past the end of the file"),
    "shape past the end": (header(1, 0) + _tensor_info("token_embd.weight", (2**31, 2**31), 0, 0) + bytes(64),
                           "ends past the end of the file"),
    "unknown tensor type": (header(1, 0) + _tensor_info("w", (32,), 99, 0) + bytes(64), "ggml type 99"),
    "truncated header": (header(0, 1) + gguf_string("general.architecture") + struct.pack("<IQ", 8, 5) + b"lla",
                         "truncated"),
    "too many dimensions": (header(1, 0) + _tensor_info("w", (1, 1, 1, 1, 1), 0, 0) + bytes(64), "5 dimensions"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused_before_allocation(case, tmp_path):
    data, reason = HOSTILE[case]
    file = tmp_path / "hostile.gguf"
    file.write_bytes(data)
    with pytest.raises(CheckpointError, match=reason):
        checkpoint.load(file)


def test_truncated_file_is_refused(gguf_files, tmp_path):
    """A real file cut short: its last tensor ends past the end of the data."""
    data = gguf_files["qwen2"]["Q8_0"].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"cut.gguf: not a valid GGUF file: tensor .* ends past the end"):
        checkpoint.load(tmp_path / "cut.gguf")


def test_weight_bytes_of_a_gguf_file_are_its_dequantized_floats(gguf_files, loaded_originals):
    """What --max-model-memory checks before loading, from the header alone: the floats the blocks become."""
    for kind in ("F32", "Q4_0"):
        assert checkpoint.weight_bytes(gguf_files["qwen2"][kind], torch.float32) == checkpoint.weight_bytes(
            loaded_originals["qwen2"].path, torch.float32)
    assert checkpoint.weight_bytes(gguf_files["llama"]["Q8_0"], torch.bfloat16) == checkpoint.weight_bytes(
        loaded_originals["llama"].path, torch.bfloat16)  # rope_freqs is config, not a weight


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    w = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="GGUF architecture 'phi2' is not supported"):
        checkpoint.load(tmp_path / "phi.gguf")


def test_llama3_rope_factors_round_trip():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = families.llama3_factors(scaling, 500000.0, 128)
    assert families.llama3_from_factors(factors, 500000.0, 128, "f") == scaling
    with pytest.raises(CheckpointError, match="not Llama 3's rope scaling"):
        families.llama3_from_factors(factors[::-1].copy(), 500000.0, 128, "f")


@pytest.mark.parametrize("original", [400, 4])
def test_llama3_rope_factors_with_no_frequency_between_the_bounds_round_trip(original):
    """Factors that are each 1 or the largest (no wavelength between the bounds: a short original context puts
    every one at or past its low-frequency bound) leave the original context open: the one read back gives the
    very same factors, with some at 1 (400) and with none (4)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": original}
    factors = families.llama3_factors(scaling, 10000.0, 8)
    assert set(np.round(factors, 6)) == ({1.0, 8.0} if original == 400 else {8.0})
    back = families.llama3_from_factors(factors, 10000.0, 8, "f")
    assert np.array_equal(families.llama3_factors(back, 10000.0, 8), factors)


def test_user_defined_tokens_are_text_and_control_tokens_are_not():
    """A GGUF vocabulary's USER_DEFINED tokens are whole words of the text (encoded as one id, decoded back),
    its CONTROL ones special (dropped from decoded text), and a CONTROL token that ends a turn stops generation."""
    from tserve.model.gguf.tokenizer import CONTROL, USER_DEFINED, end_ids, gguf_tokenizer

    tokens = ["a", "b", "Ġ", "<|im_end|>", "<tool>", "<|im_start|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
            "tokenizer.ggml.token_type": [1, 1, 1, CONTROL, USER_DEFINED, CONTROL], "tokenizer.ggml.eos_token_id": 5}
    tok = gguf_tokenizer(meta, "f")
    ids = tok.encode("a<tool>b<|im_end|>")
    assert ids == [0, 4, 1, 3]
    assert tok.decode(ids) == "a<tool>b"
    assert end_ids(meta) == [3, 5]
    assert gguf_tokenizer(meta | {"tokenizer.ggml.add_eos_token": True}, "f").encode("ab") == [0, 1, 5]
