"""GGUF files' blocks in tserve's layers (`model.gguf.blocks`): a Q8_0 / Q4_0 file's linear layers hold the file's
own codes and float16 scales (read here with the `gguf` library's reader, assembled as each family stores them: q/k
rows permuted by llama.cpp's converter, Phi-3's fused q|k|v and gate|up), compute what the block kernels' reference
computes on them, and agree with the float model; a tensor of another type in the file is quantized into the
chosen format; a K-quant (Q4_K / Q5_K / Q6_K) file is served in the nearest of tserve's formats."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.gguf_files import llama_cpp_convert, llama_cpp_dir, write_gguf
from tests.helpers.gguf_kquants import widened_llama
from tests.model.test_gguf import _agreement, _logits
from tserve.model import checkpoint
from tserve.model.block_quant import BlockLinear, quantize_q8_0, reference_linear
from tserve.model.gguf.families import unpermute_qk
from tserve.model.gguf.tensors import NEAREST_QUANTIZATION

FAMILIES = ("llama", "qwen2", "phi3")  # q/k rows permuted; an output layer tied to the embedding; q|k|v and gate|up
FLOORS = {"Q8_0": 0.95, "Q4_0": 0.85}  # teacher-forced next tokens equal to the float model's (test_gguf's floors)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-blocks-hf")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def floats(originals):
    return {f: checkpoint.load(d) for f, d in originals.items()}


@pytest.fixture(scope="module")
def served(originals, tmp_path_factory):
    """(family, kind) -> (file, the model quantize="auto" serves from it, the blocks log record)."""
    root, out = tmp_path_factory.mktemp("gguf-blocks"), {}
    for family, d in originals.items():
        for kind in FLOORS:
            file = write_gguf(d, root / f"{family}-{kind}.gguf", family, kind)
            out[family, kind] = (file, *_load_logged(file))
    return out


def _load_logged(file, said="blocks served as they are"):
    """The model quantize="auto" serves from `file`, and the first checkpoint log record that `said` (None: none)."""
    handler = _Records()
    logger = logging.getLogger("tserve.model.checkpoint")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        loaded = checkpoint.load(file, quantize="auto")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return loaded, next((r for r in handler.records if said in r.getMessage()), None)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def file_blocks(file) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
    """Every Q8_0 / Q4_0 tensor of the file as the `gguf` library reads it: codes (rows, K), float16 scales (rows,
    K / 32) and format, decoded from the format's definition (Q4_0: low nibbles weights 0..15, high 16..31, + 8)."""
    out = {}
    for t in gguf.GGUFReader(file).tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
            continue
        rows, k = int(t.shape[1]), int(t.shape[0])
        size = 34 if t.tensor_type == gguf.GGMLQuantizationType.Q8_0 else 18
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows * k // 32, size)
        scales = torch.from_numpy(blocks[:, :2].copy().view(np.float16)).reshape(rows, k // 32)
        if size == 34:
            codes, fmt = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)), "q8_0"
        else:
            packed = blocks[:, 2:]
            codes, fmt = torch.from_numpy(np.concatenate([packed & 0x0F, packed >> 4], axis=1)), "q4_0"
        out[t.name] = (codes.reshape(rows, k), scales, fmt)
    return out


def expected_layers(file, family: str, cfg) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
    """Each linear layer of ours -> the file's blocks it is made of: q, k and v one after the other, q/k rows of a
    `llama` file put back in order; the MLP's gate then up; the output layer, or the embedding where it is tied."""
    stored = file_blocks(file)

    def cat(*parts):
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2]

    def unpermuted(part, heads):
        if family != "llama":
            return part
        return unpermute_qk(part[0], heads), unpermute_qk(part[1], heads), part[2]

    out = {"lm_head": stored["token_embd.weight" if cfg.tie_embeddings else "output.weight"]}
    for i in range(cfg.n_layers):
        blk, ours = f"blk.{i}", f"blocks.{i}"
        if family == "phi3":  # stored fused, in our order
            out[f"{ours}.attn.qkv"], out[f"{ours}.mlp.gate_fc1"] = stored[f"{blk}.attn_qkv.weight"], stored[
                f"{blk}.ffn_up.weight"]
        else:
            out[f"{ours}.attn.qkv"] = cat(unpermuted(stored[f"{blk}.attn_q.weight"], cfg.n_heads),
                                          unpermuted(stored[f"{blk}.attn_k.weight"], cfg.n_kv_heads),
                                          stored[f"{blk}.attn_v.weight"])
            out[f"{ours}.mlp.gate_fc1"] = cat(stored[f"{blk}.ffn_gate.weight"], stored[f"{blk}.ffn_up.weight"])
        out[f"{ours}.attn.proj"] = stored[f"{blk}.attn_output.weight"]
        if f"{blk}.ffn_down.weight" in stored:  # (not where the mix keeps it as floats)
            out[f"{ours}.mlp.fc2"] = stored[f"{blk}.ffn_down.weight"]
    return out


def _block_layers(loaded) -> dict[str, BlockLinear]:
    return {n: m for n, m in loaded.model.named_modules() if isinstance(m, BlockLinear)}


@pytest.mark.parametrize("kind", list(FLOORS))
@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_holds_the_files_own_blocks(family, kind, served):
    """quantize="auto" serves a Q8_0 / Q4_0 file as q8_0 / q4_0, every linear layer on the file's codes and float16
    scales bit for bit (no dequantize -> quantize round trip), computing what the kernels' reference computes on
    them; the log says how many layers came from the file's blocks."""
    file, loaded, said = served[family, kind]
    assert loaded.quantization == kind.lower()
    layers, want = _block_layers(loaded), expected_layers(file, family, loaded.config)
    assert sorted(layers) == sorted(want)
    x = torch.randn(3, loaded.config.d_model, generator=torch.Generator().manual_seed(0))
    for name, layer in layers.items():
        codes, scales, fmt = want[name]
        got_codes, got_scales = layer.plain()
        assert layer.fmt == fmt, name
        assert torch.equal(got_codes, codes), name
        assert torch.equal(got_scales.view(torch.int16), scales.view(torch.int16)), name  # the bits, -0 and all
        if layer.in_features == x.size(1):
            assert torch.equal(layer(x), reference_linear(x, codes, scales, layer.bias, fmt)), name
    assert said is not None and said.layers_from_blocks == {kind.lower(): len(want)}
    assert said.layers_requantized == [] and kind in said.gguf_types


@pytest.mark.parametrize("kind", list(FLOORS))
@pytest.mark.parametrize("family", FAMILIES)
def test_served_blocks_agree_with_the_float_model(family, kind, served, floats):
    """Teacher-forced next tokens of the file served on its blocks agree with the float original's, at the floors
    the dequantize-and-requantize path met (test_gguf)."""
    assert _agreement(floats[family], served[family, kind][1], CYCLE_TEXT) >= FLOORS[kind]


def test_tensors_of_other_types_are_quantized_into_the_chosen_format(originals, tmp_path):
    """A Q4_0 file with llama.cpp's kind of mix: the output layer Q8_0 (served on its own Q8_0 blocks) and one
    projection F16 (quantized into q4_0 from its weight, and named in the log)."""
    other = {"output.weight": "Q8_0", "blk.1.ffn_down.weight": "F16"}
    file = write_gguf(originals["llama"], tmp_path / "mix.gguf", "llama", "Q4_0", types=other)
    loaded, said = _load_logged(file)
    layers = _block_layers(loaded)
    assert loaded.quantization == "q4_0"
    assert layers["lm_head"].fmt == "q8_0" and layers["blocks.1.mlp.fc2"].fmt == "q4_0"
    want = expected_layers(file, "llama", loaded.config)
    assert torch.equal(layers["lm_head"].plain()[0], want["lm_head"][0])
    assert said.layers_requantized == ["blocks.1.mlp.fc2"]
    assert said.layers_from_blocks == {"q4_0": len(layers) - 2, "q8_0": 1}


def test_an_explicit_int8_still_requantizes_a_q8_0_file(served, floats):
    explicit = checkpoint.load(served["qwen2", "Q8_0"][0], quantize="int8")
    assert explicit.quantization == "int8" and not _block_layers(explicit)
    assert _agreement(floats["qwen2"], explicit, CYCLE_TEXT) >= FLOORS["Q8_0"]


def _halve_q8_0_codes(file) -> None:
    """Every Q8_0 block of the file rewritten in place as a quantizer with an importance matrix leaves some: codes
    halved (rounded down), the scale doubled (exact in float16): the largest code about 63, not 127."""
    for t in gguf.GGUFReader(file, "r+").tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            blocks = t.data.reshape(-1, 34)
            scales = blocks[:, :2].view(np.float16)
            scales[:] = scales * np.float16(2)
            codes = blocks[:, 2:].view(np.int8)
            codes[:] = codes >> 1


def test_blocks_a_requantization_would_not_give_back_are_kept(originals, floats, tmp_path):
    """Blocks whose scale is not their largest weight / 127: quantizing their dequantized weights again gives other
    codes and scales, so only a layer that holds the file's blocks as they are passes."""
    file = write_gguf(originals["llama"], tmp_path / "halved.gguf", "llama", "Q8_0")
    _halve_q8_0_codes(file)
    loaded, said = _load_logged(file)
    want = expected_layers(file, "llama", loaded.config)
    for name, layer in _block_layers(loaded).items():
        codes, scales, _ = want[name]
        assert torch.equal(layer.plain()[0], codes) and torch.equal(layer.plain()[1], scales), name
        assert not torch.equal(quantize_q8_0(layer.dequantized_weight())[0], codes), name  # what a round trip gives
    assert said.layers_requantized == []
    assert _agreement(floats["llama"], loaded, CYCLE_TEXT) >= FLOORS["Q8_0"]


@pytest.fixture(scope="module")
def widened(originals, tmp_path_factory):
    """The tiny Llama widened to rows of 256 (K-quants' super-blocks), the same model."""
    return widened_llama(originals["llama"], tmp_path_factory.mktemp("gguf-k") / "llama-256")


@pytest.mark.parametrize(("kind", "floor"), [("Q4_K", 0.9), ("Q5_K", 0.95), ("Q6_K", 0.95)])
def test_k_quant_files_are_served_in_the_nearest_format(kind, floor, widened, floats, tmp_path):
    """A K-quant file (its attention output, of 64 inputs, Q8_0 as llama.cpp falls back) is dequantized by the
    `gguf` library and served as the nearest of tserve's formats (Q4_K int4, Q5_K / Q6_K int8), which the log
    says; its teacher-forced next tokens agree with the float original's (measured: Q4_K 98%, Q5_K 100%, Q6_K 99%
    of the tiny Llama's)."""
    original = floats["llama"]
    ids = original.tokenizer.encode(CYCLE_TEXT)[: original.config.max_seq_len]
    torch.testing.assert_close(_logits(checkpoint.load(widened), ids), _logits(original, ids), rtol=0, atol=0)
    file = write_gguf(widened, tmp_path / f"{kind}.gguf", "llama", kind)
    loaded, said = _load_logged(file, "quantized again in tserve's format")
    nearest = NEAREST_QUANTIZATION[gguf.GGMLQuantizationType[kind]]
    assert loaded.quantization == nearest == ("int4" if kind == "Q4_K" else "int8")
    assert said.nearest == nearest and said.gguf_types[kind] > said.gguf_types["Q8_0"] > 0
    assert _agreement(original, loaded, CYCLE_TEXT) >= floor


def test_a_fused_attn_qkv_keeps_its_blocks(originals, tmp_path_factory, tmp_path):
    """llama.cpp's converter with `--fuse-qkv --outtype q8_0`: one Q8_0 `attn_qkv` per layer, its rows q, k, v
    after the `llama` architecture's q/k reordering; each layer's q|k|v holds those rows split and put back."""
    root = llama_cpp_dir(tmp_path_factory.mktemp("llama-cpp"))
    file = llama_cpp_convert(root, originals["llama"], tmp_path / "fused.gguf", "q8_0", "--fuse-qkv")
    loaded, said = _load_logged(file)
    cfg, stored = loaded.config, file_blocks(file)
    assert loaded.quantization == "q8_0" and "blk.0.attn_q.weight" not in stored
    widths = [cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head]
    for i in range(cfg.n_layers):
        want = []
        for part in stored[f"blk.{i}.attn_qkv.weight"][:2]:  # codes, then scales
            q, k, v = part.split(widths)
            want.append(torch.cat([unpermute_qk(q, cfg.n_heads), unpermute_qk(k, cfg.n_kv_heads), v]))
        got = _block_layers(loaded)[f"blocks.{i}.attn.qkv"].plain()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), i
    assert said.layers_from_blocks["q8_0"] >= 4 * cfg.n_layers
