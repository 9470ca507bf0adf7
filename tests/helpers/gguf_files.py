"""GGUF files for the tests: a `save_pretrained` Llama-family directory written as llama.cpp's converter writes
it (`write_gguf`, with the `gguf` library's GGUFWriter: metadata, tokenizer, q/k rows permuted for the `llama` and
`granite` architectures, Llama 3's rope scaling as `rope_freqs`, Phi-3's LongRoPE factors as tensors, Gemma's norms
as 1 + w), or converted by llama.cpp's own `convert_hf_to_gguf.py` (`llama_cpp_convert`, from the llama-cpp-python
source distribution), a file copied with its weights quantized or metadata added (`rewrite_gguf`); and hostile
files."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers.gguf_kquants import K_TYPES, QK_K, quantize_k

ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
         "gemma2": "gemma2", "phi3": "phi3", "granite": "granite"}
PERMUTED = ("llama", "granite")  # the architectures whose q/k rows llama.cpp's converter reorders
TYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
         "BF16": gguf.GGMLQuantizationType.BF16,
         "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}
HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              # Gemma's norms after attention, before and after the MLP; Phi-3's fused projections
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
GEMMA_POST_ATTENTION = {"post_attention_layernorm": "post_attention_norm"}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), as it is there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _gguf_name(name: str, arch: str = "llama") -> str:
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[name]
    _, layer, rest = name.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    names = HF_TO_GGUF | (GEMMA_POST_ATTENTION if arch.startswith("gemma") else {})
    return f"blk.{layer}.{names[module]}.{kind}"


def _rope_factors(rope: dict, base: float, dim: int) -> np.ndarray:
    """llama.cpp's `generate_extra_tensors` for Llama 3's rope scaling."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tokenizer(w: gguf.GGUFWriter, d: Path, pre: str) -> None:
    tj = json.loads((d / "tokenizer.json").read_text())
    tc = json.loads((d / "tokenizer_config.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tj["added_tokens"]}
    vocab |= special
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    if tj["model"].get("byte_fallback"):  # SentencePiece
        types = [gguf.TokenType.BYTE if t.startswith("<0x") and len(t) == 6 else k
                 for t, k in zip(tokens, types, strict=True)]
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0 if k != gguf.TokenType.NORMAL else -float(i) for i, k in enumerate(types)])
        if "<unk>" in vocab:
            w.add_unk_token_id(vocab["<unk>"])
        if tj["pre_tokenizer"].get("prepend_scheme") == "never":
            w.add_add_space_prefix(False)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_token_list(tokens)
    w.add_token_types(types)
    if tc.get("bos_token"):
        w.add_bos_token_id(vocab[tc["bos_token"]])
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_add_bos_token(bool(tc.get("add_bos_token", tc.get("bos_token") is not None)))
    template = tc.get("chat_template") or ((d / "chat_template.jinja").read_text()
                                           if (d / "chat_template.jinja").is_file() else None)
    if template:
        w.add_chat_template(template)


def _family_metadata(w: gguf.GGUFWriter, arch: str, cfg: dict, rope: dict, local: dict | None) -> None:
    """What llama.cpp's converter stores for Gemma 2 / 3, Phi-3 and Granite, and Gemma's sliding pattern (one flag
    per layer, which its converter leaves to llama.cpp's hard-coded one)."""
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch.startswith("gemma"):
        w.add_array(f"{arch}.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in cfg["layer_types"]])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                w.add_float32(f"{arch}.{key}", cfg[key])
        if local:
            w.add_rope_freq_base_swa(local["rope_theta"])
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    if arch == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])


def write_gguf(d: Path, out: Path, family: str, kind: str = "F32", pre: str = "gpt-2",
               types: dict[str, str] | None = None) -> Path:
    """`d` (a save_pretrained directory of `family`) as a GGUF file of `kind` (F32, F16, BF16, Q8_0, Q4_0, and the
    K-quants Q4_K, Q5_K, Q6_K: the 2-D weights; norms and rope factors stay F32, as llama.cpp keeps them; a K-quant
    file's tensors whose rows are not whole super-blocks of 256 Q8_0, as llama.cpp falls back); `pre`: its
    byte-level BPE's pre-tokenizer name (`tokenizer.ggml.pre`); `types`: GGUF tensor name -> its own kind, as
    llama.cpp's mixes keep some (the output layer as Q6_K, say)."""
    cfg = json.loads((d / "config.json").read_text())
    arch = ARCHS[family]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention")
    rope = rope.get("full_attention", rope)
    rotary = int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    w.add_rope_dimension_count(rotary)
    theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _family_metadata(w, arch, cfg, rope, local)
    _tokenizer(w, d, pre)
    tensors = load_file(str(d / "model.safetensors"))
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _rope_factors(rope, theta, head_dim))
    if rope.get("rope_type") == "longrope":
        for which in ("long", "short"):
            w.add_tensor(f"rope_factors_{which}.weight", np.array(rope[f"{which}_factor"], dtype=np.float32))
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, heads, heads)
        if arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, heads, kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's converter stores its (1 + w) norms' weights as 1 + w
        stored = (types or {}).get(_gguf_name(name, arch), kind)
        if stored in K_TYPES and t.ndim == 2 and t.shape[1] % QK_K:
            stored = "Q8_0"
        if t.ndim == 2 and stored in K_TYPES:
            w.add_tensor(_gguf_name(name, arch), quantize_k(t, stored), raw_dtype=gguf.GGMLQuantizationType[stored])
        elif t.ndim == 2 and stored != "F32":
            w.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(t, TYPES[stored]), raw_dtype=TYPES[stored])
        else:
            w.add_tensor(_gguf_name(name, arch), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ------------------------------------------------------------------------------------------------------------
# llama.cpp's converter
# ------------------------------------------------------------------------------------------------------------
SDIST_GLOB = "llama_cpp_python-*.tar.gz"
_CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
# Our tiny tokenizers are not among the pre-tokenizers llama.cpp recognises by hash; theirs is GPT-2's.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# Gemma 2's and Phi-3's converters read a SentencePiece tokenizer.model only; our tiny Gemma 2 and Phi-3 have a
# byte-level BPE tokenizer.json, which they write as the converter writes any (Gemma 3's, Phi-4-mini's do so).
import conversion.gemma as gemma, conversion.phi as phi
for model in (gemma.Gemma2Model, phi.Phi3MiniModel):
    model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_dir(cache: Path) -> Path:
    """llama.cpp's tree (convert_hf_to_gguf.py, gguf-py) from the llama-cpp-python source distribution, found in
    $TSERVE_LLAMA_CPP_SDIST (a directory holding the .tar.gz, fetched with
    `pip download --no-deps --no-binary :all: llama-cpp-python`) and unpacked into `cache`. Skips where it is
    absent, unless TSERVE_REQUIRE_TOOLS is set."""
    where = os.environ.get("TSERVE_LLAMA_CPP_SDIST")
    sdists = sorted(Path(where).glob(SDIST_GLOB)) if where else []
    if not sdists:
        reason = ("llama.cpp's converter: set TSERVE_LLAMA_CPP_SDIST to a directory holding the llama-cpp-python "
                  "source distribution (pip download --no-deps --no-binary :all: llama-cpp-python)")
        if os.environ.get("TSERVE_REQUIRE_TOOLS"):
            pytest.fail(reason)
        pytest.skip(reason)
    sdist = sdists[-1]
    root = cache / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (root / "convert_hf_to_gguf.py").is_file():
        with tarfile.open(sdist) as tar:
            prefix = sdist.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
            wanted = [m for m in tar.getmembers() if m.name.startswith(prefix) and (
                m.name == prefix + "convert_hf_to_gguf.py" or m.name.startswith((prefix + "conversion/",
                                                                                 prefix + "gguf-py/")))]
            tar.extractall(cache, members=wanted, filter="data")
    return root


def llama_cpp_convert(root: Path, d: Path, out: Path, outtype: str = "f32", *options: str) -> Path:
    """`d` converted by llama.cpp's convert_hf_to_gguf.py to `out` (`options`: more of its flags, `--fuse-qkv`)."""
    copy = out.parent / (d.name + "-for-llama-cpp")
    shutil.copytree(d, copy, dirs_exist_ok=True)
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(root), str(copy), "--outfile", str(out),
                           "--outtype", outtype, *options], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# ------------------------------------------------------------------------------------------------------------
# Hostile files
# ------------------------------------------------------------------------------------------------------------
def header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def gguf_string(s: str | bytes, length: int | None = None) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def rewrite_gguf(src: Path, out: Path, kind: str = "F32", metadata: dict | None = None) -> Path:
    """A copy of the GGUF file `src` (an F32 file, from llama.cpp's converter say) with its 2-D weights quantized to
    `kind` by the `gguf` library as llama.cpp's quantizer writes them (norms, rope factors stay F32), and
    `metadata` (key: value) added or replaced: what a file of that type or with that key holds."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    metadata = dict(metadata or {})
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", *metadata}
    for key, field in reader.fields.items():
        if key in skip:
            continue
        kinds = field.types
        if kinds[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), kinds[0])
    for key, value in metadata.items():
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.UINT32 if isinstance(value, int) else
                            gguf.GGUFValueType.FLOAT32)
    for t in reader.tensors:
        data = np.array(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
        if data.ndim == 2 and kind != "F32":
            w.add_tensor(t.name, gguf.quants.quantize(data, TYPES[kind]), raw_dtype=TYPES[kind])
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
