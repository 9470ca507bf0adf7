"""A GGUF file's tensors as float tensors, one at a time: F32 / F16 / BF16 as they are, Q8_0 and Q4_0 blocks
dequantized here (PyTorch: the two formats every GGUF release ships), every other block format (K-quants
Q2_K..Q6_K, Q4_1, Q5_0, Q5_1, ...) by the `gguf` library's numpy dequantizers. The model is filled with those
floats; then, with quantize="auto" (`model.checkpoint.load`), its linear layers take the nearest of tserve's
formats (`NEAREST_QUANTIZATION`): Q8_0 and Q4_0 layers are served on the file's own blocks, codes and float16
scales as stored (`GGUFWeights.rows` / `block_rows`, assembled per layer by `gguf.blocks`), K-quants and the rest
are quantized again from the floats."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from torch import Tensor

from tserve.model.gguf.families import CONFIG_TENSORS, Family, hf_name, unpermute_qk
from tserve.model.gguf.header import Header, TensorInfo
from tserve.model.importers.base import CheckpointError

Q = GGMLQuantizationType
FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
QK = 32  # weights per Q8_0 / Q4_0 block
# Which of tserve's formats serves a file whose linear weights are mostly of a type: llama.cpp's own blocks for
# Q8_0 and Q4_0 (`model.block_quant`: the file's blocks as they are), else the nearest one that loses nothing the
# file kept (5- and 6-bit weights into int8, not int4).
NEAREST_QUANTIZATION = {
    Q.F32: "none", Q.F16: "none", Q.BF16: "none",
    Q.Q8_0: "q8_0", Q.Q4_0: "q4_0",
    Q.Q6_K: "int8", Q.Q5_K: "int8", Q.Q5_0: "int8", Q.Q5_1: "int8",
    Q.Q4_1: "int4", Q.Q4_K: "int4", Q.Q3_K: "int4", Q.Q2_K: "int4",
}
BLOCK_FORMATS = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0"}  # the GGUF types `model.block_quant`'s layers hold as they are
_ROW_BITS = 32  # `GGUFWeights.rows`: a row's id is (tensor number << 32) + row


def dequantize_q8_0(blocks: Tensor) -> Tensor:
    """(n, 34) uint8 Q8_0 blocks -> (n, 32) float32: a float16 scale d, then 32 int8 codes q; x = d * q."""
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # (n, 1)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n, 32)
    return d * q


def dequantize_q4_0(blocks: Tensor) -> Tensor:
    """(n, 18) uint8 Q4_0 blocks -> (n, 32) float32: a float16 scale d, then 16 bytes whose low nibbles are
    weights 0..15 and high nibbles 16..31, each stored + 8; x = d * (nibble - 8)."""
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # (n, 1)
    packed = blocks[:, 2:].to(torch.int16)  # (n, 16)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1) - 8  # (n, 32)
    return d * q.float()


def q8_0_codes(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(n, 34) uint8 Q8_0 blocks -> codes (n, 32) int8 and scales (n,) float16, as stored."""
    return blocks[:, 2:].contiguous().view(torch.int8), blocks[:, :2].contiguous().view(torch.float16)[:, 0]


def q4_0_codes(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(n, 18) uint8 Q4_0 blocks -> codes (n, 32) uint8 0..15 (weight = (code - 8) x scale, `model.block_quant`'s
    convention: the stored nibble itself) and scales (n,) float16; low nibbles are weights 0..15, high 16..31."""
    packed = blocks[:, 2:]
    return torch.cat([packed & 0x0F, packed >> 4], dim=1), blocks[:, :2].contiguous().view(torch.float16)[:, 0]


def to_blocks(rows: np.ndarray, kind: Q) -> tuple[Tensor, Tensor]:
    """Stored rows of a Q8_0 / Q4_0 tensor, (n, bytes a row) uint8, as their codes (n, K) and float16 scales
    (n, K / 32), as the file has them."""
    n = rows.shape[0]
    data = torch.from_numpy(np.asarray(rows, dtype=np.uint8))
    split = q8_0_codes if kind == Q.Q8_0 else q4_0_codes
    codes, scales = split(data.reshape(-1, 2 + (QK if kind == Q.Q8_0 else QK // 2)))
    return codes.reshape(n, -1), scales.reshape(n, -1)


def to_float(raw: np.ndarray, info: TensorInfo) -> Tensor:
    """One tensor's bytes (`info.n_bytes` of them) as a float tensor of PyTorch's shape (GGUF's reversed)."""
    shape = tuple(reversed(info.shape))
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    if info.kind in FLOATS:
        return data.view(FLOATS[info.kind]).reshape(shape)
    if info.kind == Q.Q8_0:
        return dequantize_q8_0(data.reshape(-1, 2 + QK)).reshape(shape)
    if info.kind == Q.Q4_0:
        return dequantize_q4_0(data.reshape(-1, 2 + QK // 2)).reshape(shape)
    try:
        out = quants.dequantize(data.numpy().reshape(*shape[:-1], -1), info.kind)  # rows of whole blocks
    except NotImplementedError as exc:
        raise CheckpointError(f"tensor {info.name!r}: GGUF type {info.kind.name} cannot be dequantized by the "
                              f"gguf library") from exc
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


class GGUFWeights:
    """A GGUF file's tensors under Hugging Face names, read and dequantized one at a time when asked for:
    the interface of `model.importers.base.WeightSource`, so the family's importer reads it unchanged. q/k
    rows are put back in Hugging Face's order where llama.cpp's converter reordered them, and norm weights as
    they were where it shifted them (`Family.norm_shift`). q, k and v fused into one `attn_qkv` (the converter's
    `--fuse-qkv`) are split again for a family whose checkpoints keep them apart."""

    def __init__(self, data: np.ndarray, header: Header, path: object, family: Family) -> None:
        self.file = path
        self._data, self._header, self._family = data, header, family
        self._heads: dict[str, int] = {}
        self._n_heads = (0, 0)  # query and kv heads (`set_heads`)
        self._where: dict[str, TensorInfo] = {}
        self._fused_part: dict[str, int] = {}  # q_proj / k_proj / v_proj name -> its place in a fused attn_qkv
        self._number = {name: n for n, name in enumerate(header.tensors)}  # `rows`' ids
        self._by_number = list(header.tensors.values())
        for name, info in header.tensors.items():
            if (hf := hf_name(name, family)) is not None:
                self._where[hf] = info
            elif name.split(".")[2:3] == ["attn_qkv"] and (q := hf_name(name.replace("attn_qkv", "attn_q"), family)):
                for part, projection in enumerate(("q_proj", "k_proj", "v_proj")):
                    self._where[q.replace("q_proj", projection)] = info
                    self._fused_part[q.replace("q_proj", projection)] = part
            elif name not in CONFIG_TENSORS:
                raise CheckpointError(f"{path}: tensor {name!r} is not one the Llama layout has")

    def set_heads(self, n_heads: int, n_kv_heads: int) -> None:
        """The head counts the q and k rows are put back by (where the architecture's were reordered), and a
        fused attn_qkv split by."""
        self._n_heads = (n_heads, n_kv_heads)
        self._heads = {"q_proj": n_heads, "k_proj": n_kv_heads} if self._family.permuted_qk else {}

    def raw(self, info: TensorInfo) -> np.ndarray:
        start = self._header.data_start + info.offset
        return self._data[start:start + info.n_bytes]

    def read(self, gguf_name: str) -> Tensor | None:
        """A tensor by its GGUF name, as stored (dequantized); None when the file has none of that name."""
        info = self._header.tensors.get(gguf_name)
        return None if info is None else to_float(self.raw(info), info)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> Tensor:
        info = self._where[name]  # KeyError: the loader names the file and the tensor
        tensor = self._arranged(name, to_float(self.raw(info), info))
        if self._family.norm_shift and name.endswith("norm.weight"):
            tensor = tensor - self._family.norm_shift
        return tensor

    def _arranged(self, name: str, tensor: Tensor) -> Tensor:
        """A stored tensor's rows as the Hugging Face tensor `name` has them (of any columns: the same for its
        float weights and for its `rows`)."""
        if name in self._fused_part:  # rows: q of every head, then k and v of every kv head
            heads, kv = self._n_heads
            head_dim = tensor.shape[0] // (heads + 2 * kv)
            tensor = tensor.split([heads * head_dim, kv * head_dim, kv * head_dim])[self._fused_part[name]]
        projection = name.split(".")[-2]
        if projection in self._heads:
            tensor = unpermute_qk(tensor, self._heads[projection])
        return tensor

    def rows(self, name: str) -> Tensor:
        """Where each row of the tensor `name` (as `self[name]` gives it) is stored: (rows, 1) float64 ids, the
        stored tensor's number << 32 plus its row. An importer that only moves rows (concatenates, splits) moves
        these as it moves the weights, so its output says which stored rows a layer of ours is made of."""
        info = self._where[name]
        ids = torch.arange(info.shape[-1], dtype=torch.float64) + float(self._number[info.name] << _ROW_BITS)
        return self._arranged(name, ids.unsqueeze(1))  # (PyTorch's first dimension is GGUF's last)

    def block_rows(self, ids: Tensor) -> tuple[Tensor, Tensor, str] | None:
        """The stored Q8_0 / Q4_0 codes and float16 scales of the rows `ids` (from `rows`), in that order, and their
        format (`model.block_quant`'s name); None unless every row is of the same one of those two types and width."""
        ids = ids.reshape(-1).long()
        numbers = ids >> _ROW_BITS
        infos = [self._by_number[int(n)] for n in numbers.unique()]
        if len({(i.kind, i.shape[0]) for i in infos}) != 1 or infos[0].kind not in BLOCK_FORMATS:
            return None
        fmt, rows = BLOCK_FORMATS[infos[0].kind], ids & ((1 << _ROW_BITS) - 1)
        if len(infos) == 1:  # only the rows asked for are read from the file (a copy: fancy indexing)
            return (*to_blocks(self._stored_rows(infos[0])[rows.numpy()], infos[0].kind), fmt)
        codes = torch.empty(len(ids), infos[0].shape[0], dtype=torch.int8 if fmt == "q8_0" else torch.uint8)
        scales = torch.empty(len(ids), infos[0].shape[0] // QK, dtype=torch.float16)
        for info in infos:
            where = (numbers == self._number[info.name]).nonzero().squeeze(1)
            codes[where], scales[where] = to_blocks(self._stored_rows(info)[rows[where].numpy()], info.kind)
        return codes, scales, fmt

    def _stored_rows(self, info: TensorInfo) -> np.ndarray:
        """A tensor's bytes as its stored rows, (rows, bytes a row), mapped (nothing read yet)."""
        return self.raw(info).reshape(info.shape[-1], -1)

    def get(self, name: str) -> Tensor | None:
        return self[name] if name in self else None

    def strip_prefix(self, prefix: str) -> GGUFWeights:
        if any(n.startswith(prefix) for n in self._where):
            self._where = {n.removeprefix(prefix): w for n, w in self._where.items()}
            self._fused_part = {n.removeprefix(prefix): p for n, p in self._fused_part.items()}
        return self

    def weight_types(self) -> Counter[str]:
        """Elements per GGUF type over the 2-D weights (the linear layers and the embedding)."""
        counts: Counter[str] = Counter()
        for info in {i.name: i for i in self._where.values()}.values():  # a fused attn_qkv once
            if len(info.shape) == 2:
                counts[info.kind.name] += int(np.prod(info.shape))
        return counts

    def nearest_quantization(self) -> str:
        """tserve's format nearest the type most of the linear layers' weights have (`NEAREST_QUANTIZATION`)."""
        counts: Counter[Q] = Counter()
        for name, info in {i.name: (n, i) for n, i in self._where.items()}.values():
            if len(info.shape) == 2 and name.startswith(("model.layers.", "layers.")):
                counts[info.kind] += int(np.prod(info.shape))
        if not counts:
            return "none"
        return NEAREST_QUANTIZATION.get(counts.most_common(1)[0][0], "int8")
