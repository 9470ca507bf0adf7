"""GGUF files (llama.cpp's format) as checkpoints: `--model NAME=path/to/file.gguf`.

A file is read as the Hugging Face checkpoint it was converted from, so the family's importer
(`model.importers`) maps it like any directory:

    header.py     the header walked and checked against the file's size before anything is read or allocated
    families.py   metadata -> config.json's fields, llama.cpp's tensor names -> Hugging Face's, per family
    tensors.py    tensors dequantized one at a time (F32/F16/BF16, Q8_0, Q4_0 here; K-quants by `gguf`), and a
                  Q8_0 / Q4_0 tensor's rows as the codes and float16 scales it stores
    blocks.py     which stored rows each linear layer of the built model is made of: its blocks as they are
    tokenizer.py  `tokenizer.ggml.*` -> a `tokenizers.Tokenizer` with the original's ids

The header (metadata and tensor table) is read by `header.read_header`, which checks it against the file; the
tensor data is mapped, not read, until the loader asks for a tensor. The model is filled with the dequantized
floats; with quantize="auto" the loader then serves the linear layers in the nearest of tserve's formats
(`tensors.NEAREST_QUANTIZATION`): a Q8_0 / Q4_0 file as q8_0 / q4_0, each such layer on the file's own blocks
(`blocks.FileBlocks`, no requantizing), a K-quant file as int8 / int4 quantized again; the log says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tserve.model.gguf.families import CONFIG_TENSORS, family_of, hf_config
from tserve.model.gguf.header import MAGIC, read_header
from tserve.model.gguf.tensors import GGUFWeights
from tserve.model.gguf.tokenizer import end_ids, gguf_tokenizer
from tserve.model.tokenizer import HFTokenizer

__all__ = ["GGUFCheckpoint", "is_gguf"]


def is_gguf(path: Path) -> bool:
    """A file named *.gguf, or any file that starts with GGUF's magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


class GGUFCheckpoint:
    """One GGUF file: its config.json fields (`raw`), weights (`weights`, a WeightSource), tokenizer and end
    ids. Raises CheckpointError for a file that is not a readable GGUF checkpoint of a supported family."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header = read_header(path)
        self.meta: dict[str, Any] = self.header.metadata
        _, family = family_of(self.meta, path)
        data = np.memmap(path, dtype=np.uint8, mode="r")
        self.weights = GGUFWeights(data, self.header, path, family)
        config_tensors = {name: t.double().numpy() for name in CONFIG_TENSORS
                          if (t := self.weights.read(name)) is not None}
        self.raw = hf_config(self.meta, self.header.tensors, path, config_tensors)
        self.weights.set_heads(self.raw["num_attention_heads"], self.raw["num_key_value_heads"])
        self.family = family

    def tokenizer(self) -> HFTokenizer:
        return gguf_tokenizer(self.meta, self.path)

    def end_ids(self) -> list[int]:
        return end_ids(self.meta)
