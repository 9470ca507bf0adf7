"""Checkpoints: our own format, and detection of Hugging Face directories.

Our format is a directory holding
    config.json             the model config, with "architecture": decoder | seq2seq | vit
    model.safetensors       weights (never pickle)
    tokenizer files         for text models (see model.tokenizer)
    generation.json         optional decoding defaults (num_beams, max_new_tokens, ...)
    labels.json             classifiers: class names, index order
    preprocessing.json      classifiers: image preprocessing
`load(path)` reads that, or a Hugging Face directory (`model.importers`: GPT-2, Marian, ViT, Llama, Mistral,
Qwen2, Qwen3), or a GGUF file (`model.gguf`: read as the Hugging Face checkpoint it was converted from),
assembling the model the same way for every format.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tserve.model.attention import resolve_backend
from tserve.model.config import BlockConfig, DecoderConfig, Seq2SeqConfig
from tserve.model.decoder import Decoder
from tserve.model.gguf import GGUFCheckpoint, is_gguf
from tserve.model.gguf.blocks import FileBlocks
from tserve.model.gguf.families import CONFIG_TENSORS
from tserve.model.gguf.header import read_header
from tserve.model.importers import CheckpointError, GenerationDefaults, WeightSource, importer_for
from tserve.model.importers.base import read_json
from tserve.model.layers import fuse_gated_mlps
from tserve.model.packed_linear import onednn_linears, pack_linears
from tserve.model.preprocessing import ImagePreprocessing
from tserve.model.quantize import (
    BLOCK_FORMATS,
    QUANTIZATIONS,
    quantize_blocks,
    quantize_int4,
    quantize_int8,
    quantized_bytes_change,
    resolve_activations,
)
from tserve.model.seq2seq import Seq2Seq
from tserve.model.tokenizer import Tokenizer, load_tokenizer
from tserve.model.uninitialized import uninitialized_weights
from tserve.model.vit import ViT

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "GenerationDefaults", "LoadedModel", "build_model", "load", "save_checkpoint",
           "resolve_device", "resolve_dtype", "select_device", "translation_languages", "weight_bytes"]

TASKS = {"decoder": "text-generation", "seq2seq": "translation", "vit": "image-classification"}
MODEL_CLASSES: dict[str, type[nn.Module]] = {"decoder": Decoder, "seq2seq": Seq2Seq, "vit": ViT}


@dataclass
class LoadedModel:
    """A model ready to serve: module on its device, and what is needed around it."""

    path: Path
    task: str
    config: BlockConfig
    model: nn.Module
    tokenizer: Tokenizer | None = None
    labels: list[str] | None = None
    preprocessing: ImagePreprocessing | None = None
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    source_format: str = "tserve"  # or "hf-<model_type>": "hf-gpt2", "hf-llama", ...
    quantization: str = "none"  # or "int8" / "int4": the linear layers hold int8 / int4 weights
    # How those weights compute, where a format has a choice: int8's activation scheme, int4's group size.
    quantization_options: dict[str, Any] = field(default_factory=dict)
    parameter_count: int = 0  # counted at load: packed and int8 layers hold their weights outside `parameters()`
    languages: tuple[str, str] | None = None  # a translator's (source, target) language codes, when known

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def architecture(self) -> str:
        return self.config.architecture

    def num_parameters(self) -> int:
        return self.parameter_count or sum(p.numel() for p in self.model.parameters())


_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def weight_bytes(path: str | Path, dtype: torch.dtype, quantize: str = "none", int8_activations: str = "auto",
                 int4_group_size: int = 32) -> int:
    """What a checkpoint's weights take in memory with its floating tensors in `dtype`, from the safetensors
    headers alone (no tensor is read): what a loader can check against a memory budget first. `quantize` (and its
    options, as `load` takes them): the linear layers counted as that format holds them, found in the model
    config.json describes, built on the meta device (`model.quantize.quantized_bytes_change`). A GGUF file's
    tensors count as the floats they are dequantized to, whatever the quantization."""
    if is_gguf(Path(path)):
        return sum(math.prod(t.shape) for t in read_header(Path(path)).tensors.values()
                   if t.name not in CONFIG_TENSORS) * dtype.itemsize
    total = 0 if quantize in ("none", "auto") else quantized_bytes_change(
        _skeleton(Path(path), dtype), quantize, int8_activations, int4_group_size)
    for file in WeightSource.files(Path(path)):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            kind = info["dtype"]
            size = dtype.itemsize if kind.startswith(("F", "BF")) and not kind.startswith("F8") else _ELEMENT_BYTES[kind]
            total += math.prod(info["shape"]) * size
    return total


def build_model(config: BlockConfig, backend: str = "auto") -> nn.Module:
    return MODEL_CLASSES[config.architecture](config, backend=backend)


def _skeleton(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model a checkpoint directory's config.json describes, on the meta device (no weight read or
    allocated), in `dtype` and with its gated MLPs fused, as `load` quantizes it."""
    raw = _config_json(path)
    importer, _ = importer_for(raw, path / "config.json")
    with torch.device("meta"), torch.no_grad():
        model = build_model(_importer_config(importer, raw, path)).to(dtype)
        fuse_gated_mlps(model)
    return model


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    *,
    tokenizer: Tokenizer | None = None,
    labels: list[str] | None = None,
    preprocessing: ImagePreprocessing | None = None,
    generation: GenerationDefaults | None = None,
    extra_files: dict[str, str] | None = None,
    languages: tuple[str, str] | None = None,
) -> Path:
    """Write a checkpoint in our format. Weights are stored in float32 unless the model is in bf16/fp16.
    `languages`: a translator's (source, target) codes, kept in config.json as source_lang / target_lang."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.cfg.save(path / "config.json")
    if languages is not None:
        raw = json.loads((path / "config.json").read_text())
        raw |= {"source_lang": languages[0], "target_lang": languages[1]}
        (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(model.cfg, "tie_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as tok_emb.weight
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", "producer": "tserve"})
    if tokenizer is not None:
        tokenizer.save(path)
    if labels is not None:
        (path / "labels.json").write_text(json.dumps(labels, indent=2, ensure_ascii=False) + "\n")
    if preprocessing is not None:
        preprocessing.save(path / "preprocessing.json")
    if generation is not None:
        (path / "generation.json").write_text(json.dumps(asdict(generation), indent=2) + "\n")
    for name, text in (extra_files or {}).items():
        (path / name).write_text(text)
    return path


def fill_weights(model: nn.Module, named: Iterator[tuple[str, torch.Tensor]], file: Path) -> None:
    """Copy each (name, tensor) into the model's parameter of that name as it comes (converted to the
    parameter's dtype), so that no second copy of the whole checkpoint is ever held; names the file and the
    keys when they do not fit the config."""
    expected = model.state_dict()
    # Tied output weights are stored once, under the embedding's name.
    tied = {k for k in expected if k.endswith("lm_head.weight")} if getattr(model.cfg, "tie_embeddings", False) else set()
    seen, unexpected = set(), []
    try:
        with torch.no_grad():
            for name, tensor in named:
                if name not in expected:
                    unexpected.append(name)
                    continue
                if tensor.shape != expected[name].shape:
                    raise CheckpointError(f"{file}: {name} has shape {tuple(tensor.shape)}, config expects "
                                          f"{tuple(expected[name].shape)}")
                expected[name].copy_(tensor)
                seen.add(name)
    except KeyError as exc:
        raise CheckpointError(f"{file}: expected tensor or config field {exc} not found") from exc
    missing = sorted(set(expected) - seen - tied)
    if missing or unexpected:
        raise CheckpointError(f"{file}: weights do not match the config (missing {missing[:8]}, "
                              f"unexpected {sorted(unexpected)[:8]})")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, float32, bfloat16 or float16")
    return table[dtype]


def cpu_bfloat16_native() -> bool:
    """Whether this process's CPU kernels compute bfloat16 in hardware: AVX512-BF16 or AMX, with PyTorch's kernels
    not held to AVX2 (ATEN_CPU_CAPABILITY). Elsewhere on x86 every bfloat16 product is converted and computed in
    float32, slower than float32 itself. Other architectures: PyTorch's own choice (True)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def emulated_bfloat16_note(dtype: torch.dtype, device: torch.device) -> str | None:
    """What to tell a user loading bfloat16 weights on a CPU that only emulates bfloat16 (None elsewhere). Kept,
    not refused or upcast: the products convert to float32 as they read, and reading half the bytes still
    wins (GPT-2 small, kernels held to AVX2: 36.5 ms a step against float32's 42.5; docs/BENCHMARKS.md)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cpu_bfloat16_native():
        return None
    return ("bfloat16 on this CPU is emulated (no AVX512-BF16 or AMX, or PyTorch's kernels held to "
            f"{torch.backends.cpu.get_cpu_capability()}): each product converts to float32; it reads half of "
            "float32's bytes, but --quantize int8 is faster and as accurate")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`auto`: CUDA when present, else CPU. Asking for CUDA without one is a clear error."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but CUDA is not available here")
    return device


def select_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (CUDA keeps one per thread), so that what runs
    without naming a device (Triton launches, CUDA-graph capture, new streams) runs on the model's GPU.
    Called by the loader and at the start of every worker thread; nothing to do on a CPU."""
    if device.type == "cuda" and device.index is not None:  # bare "cuda" is the thread's current device already
        torch.cuda.set_device(device)


def load(
    path: str | Path,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    backend: str = "auto",
    quantize: str = "none",
    int8_activations: str = "auto",
    int4_group_size: int = 32,
    pack_weights: bool = False,
    fused_layers: bool = False,
) -> LoadedModel:
    """Load our checkpoint, a Hugging Face directory or a GGUF file (`model.gguf`) onto `device`. `quantize="int8"`:
    int8 weights for every linear layer (`model.quantize`; float32 on the CPU only), with activations quantized
    as `int8_activations` says (`model.quantize.ACTIVATIONS`); `quantize="int4"`: group-wise int4 weights
    (`int4_group_size` weights per scale; float32 on the CPU only); `quantize="q8_0"` / `"q4_0"`: llama.cpp's
    block formats (`model.block_quant`). `pack_weights`: float32
    linear layers on the CPU get pre-packed weights (`model.packed_linear`; the model is for inference only), unless
    the decode steps fuse on the weights as they are (`fused_layers`).
    `quantize="auto"`: the checkpoint's own, the nearest of ours for a block-quantized GGUF file (`gguf_quantization`;
    with q8_0 / q4_0 a GGUF file's own Q8_0 / Q4_0 blocks are kept as they are), none for every other.
    `fused_layers`: a language model's one-token decode steps run through all its layers in one C++ call where its
    layout and weights allow (`model.fused_decode`)."""
    if quantize not in (*QUANTIZATIONS, "auto"):
        raise ValueError(f"quantize must be one of {(*QUANTIZATIONS, 'auto')}, got {quantize!r}")
    path = Path(path)
    start = time.perf_counter()
    dev = resolve_device(device)
    gguf_file = GGUFCheckpoint(path) if is_gguf(path) else None
    as_stored = quantize == "auto"  # a GGUF file's own blocks in either format; a format named is the one served
    if gguf_file is not None:
        raw = gguf_file.raw
        if quantize == "auto":
            quantize = gguf_quantization(gguf_file, dev, resolve_dtype(dtype, dev))
    else:
        raw = _config_json(path)
    quantize = "none" if quantize == "auto" else quantize  # the checkpoint's own: float weights say none
    if note := emulated_bfloat16_note(resolve_dtype(dtype, dev), dev):
        log.warning(note, extra={"path": str(path)})
    loaded = _assemble(path, raw, resolve_backend(backend, dev), gguf_file)
    select_device(dev)
    loaded.model.to(device=dev, dtype=resolve_dtype(dtype, dev)).eval()
    loaded.parameter_count = parameters = loaded.num_parameters()
    if pack_weights or quantize != "none" or fused_layers:  # served: fewer, larger products (the fused step's too)
        fuse_gated_mlps(loaded.model)
    quantized = {}
    if quantize == "int8":
        quantized["int8_activations"] = activations = resolve_activations(int8_activations)
        quantize_int8(loaded.model, activations)
        loaded.quantization = "int8"
    elif quantize == "int4":
        quantized["int4_group_size"] = int4_group_size
        quantize_int4(loaded.model, int4_group_size)
        loaded.quantization = "int4"
    elif quantize in ("q8_0", "q4_0"):  # llama.cpp's blocks of 32 (model.block_quant)
        # A GGUF file's own Q8_0 / Q4_0 blocks as they are (model.gguf.blocks); every other layer quantized.
        given = None if gguf_file is None else \
            FileBlocks(gguf_file.weights, importer_for(raw, path)[0], loaded.config, loaded.model, as_stored)
        quantize_blocks(loaded.model, quantize, given)
        if given is not None:
            given.report(path, quantize, dict(gguf_file.weights.weight_types()))
        loaded.quantization = quantize
    loaded.quantization_options = dict(quantized)
    fuses = fused_layers and hasattr(loaded.model, "fuse_decode")
    # A float32 model whose decode steps fuse keeps its weights as they are (the fused step reads them row by row,
    # `dense_rows`; prefill's larger products lay them out per call, on oneDNN); the others are pre-packed, then
    # tried again.
    if pack_weights and quantize == "none":
        if fuses and loaded.model.fuse_decode():
            onednn_linears(loaded.model)
        else:
            pack_linears(loaded.model)
    if fuses:  # after the weights took their final form
        quantized["fused_layers"] = loaded.model.fused is not None or loaded.model.fuse_decode()
    log.info(
        "model loaded",
        extra={"path": str(path), "task": loaded.task, "format": loaded.source_format, "device": str(dev),
               "dtype": str(loaded.dtype), "quantization": loaded.quantization, **quantized, "parameters": parameters,
               "seconds": round(time.perf_counter() - start, 3)},
    )
    return loaded


def _config_json(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (nor a GGUF file)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (a checkpoint directory needs config.json)")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from exc


def gguf_quantization(gguf_file: GGUFCheckpoint, device: torch.device, dtype: torch.dtype) -> str:
    """quantize="auto" for a GGUF file: tserve's format nearest its block quantization (`tensors.NEAREST_QUANTIZATION`:
    Q8_0 / Q4_0 on their own blocks, q8_0 / q4_0; K-quants and the rest dequantized and quantized again as int8 /
    int4), on a float32 CPU model (those layers are CPU-only; elsewhere the dequantized floats); logged."""
    types = dict(gguf_file.weights.weight_types())
    nearest = gguf_file.weights.nearest_quantization()
    served = nearest if device.type == "cpu" and dtype == torch.float32 else "none"
    if nearest not in ("none", *BLOCK_FORMATS):
        log.info("GGUF block-quantized weights dequantized and quantized again in tserve's format",
                 extra={"path": str(gguf_file.path), "gguf_types": types, "nearest": nearest, "quantization": served})
    if served != nearest:
        log.info("GGUF block-quantized weights dequantized to floats",
                 extra={"path": str(gguf_file.path), "gguf_types": types, "nearest": nearest, "quantization": served,
                        "why": f"{nearest} layers need float32 on the CPU, not {dtype} on {device}"})
    return served


_LANGUAGE_CODE = re.compile(r"[a-z]{2,3}(?:[_-][A-Za-z0-9]{2,8})*")
_OPUS_MT_NAME = re.compile(r"opus-mt-([a-z]{2,3})-([a-z]{2,3})(?:$|[-_])")


def translation_languages(path: Path, raw: dict[str, Any]) -> tuple[str, str] | None:
    """A translator's (source, target) language codes: `source_lang` / `target_lang` in config.json (ours) or
    in tokenizer_config.json (Hugging Face), else an `opus-mt-xx-yy` directory name; None when none says."""
    tokenizer_config = read_json(path / "tokenizer_config.json", required=False) or {}
    for where, data in ((path / "config.json", raw), (path / "tokenizer_config.json", tokenizer_config)):
        source, target = data.get("source_lang"), data.get("target_lang")
        if source is None and target is None:
            continue
        if not all(isinstance(c, str) and _LANGUAGE_CODE.fullmatch(c) for c in (source, target)):
            raise CheckpointError(f"{where}: source_lang and target_lang must both be language codes such as "
                                  f"'en', got {source!r} and {target!r}")
        return source, target
    m = _OPUS_MT_NAME.search(path.resolve().name)
    return (m.group(1), m.group(2)) if m else None


def _importer_config(importer: Any, raw: dict[str, Any], path: Path) -> BlockConfig:
    """The importer's config of `raw`; what it cannot read is a CheckpointError naming config.json."""
    try:
        return importer.config(raw, path)
    except KeyError as exc:
        raise CheckpointError(f"{path / 'config.json'}: expected config field {exc} not found") from exc
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from exc


def _assemble(path: Path, raw: dict[str, Any], backend: str, gguf_file: GGUFCheckpoint | None = None) -> LoadedModel:
    """Build the model its importer describes, fill its weights, and attach what serving it needs: the
    tokenizer (text models), the languages (translators), generation defaults, labels and preprocessing.
    A GGUF file brings its own config fields, weights, tokenizer and end ids (`model.gguf`)."""
    if gguf_file is not None:
        importer, source_format = importer_for(raw, path)
        source_format = "gguf-" + source_format.removeprefix("hf-")
    else:
        importer, source_format = importer_for(raw, path / "config.json")
    config = _importer_config(importer, raw, path)
    with uninitialized_weights():  # every parameter is filled below (fill_weights refuses a checkpoint short of one)
        model = build_model(config, backend)
    source = gguf_file.weights if gguf_file is not None else WeightSource(path)
    fill_weights(model, importer.weights(config, source), source.file)
    extras = importer.extras(raw, path, config) if hasattr(importer, "extras") else {}
    loaded = LoadedModel(path, extras.pop("task", None) or TASKS[config.architecture], config, model,
                         source_format=source_format, **extras)
    if gguf_file is not None:
        loaded.generation = GenerationDefaults(eos_token_ids=gguf_file.end_ids())
        loaded.tokenizer = gguf_file.tokenizer()
        return loaded
    if hasattr(importer, "generation"):
        loaded.generation = importer.generation(raw, path)
    if isinstance(config, Seq2SeqConfig):
        loaded.languages = translation_languages(path, raw)
    if isinstance(config, DecoderConfig | Seq2SeqConfig):
        try:
            loaded.tokenizer = load_tokenizer(path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
    return loaded
