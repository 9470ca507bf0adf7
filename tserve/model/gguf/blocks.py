"""A GGUF file's Q8_0 / Q4_0 blocks served as they are: which stored rows each linear layer of the built model is
made of, and those rows' codes and float16 scales (`model.quantize.quantize_blocks`' `given`).

The family's importer says how the file's tensors become our parameters (q, k and v concatenated, Phi-3's gate and
up split, ...) and `GGUFWeights` how stored rows become Hugging Face's (q/k rows put back in order, a fused attn_qkv
split): both only move rows. So the importer is run a second time on each tensor's row ids instead of its weights
(`GGUFWeights.rows`: (rows, 1) each, no weight is read), and what it yields for a parameter is where each of its
rows is stored. A layer made after loading from several (the MLP's gate and up as one product,
`layers.fuse_gated_mlps`) is matched to the parameters it replaced in the order whose blocks give its weight.

Every layer's blocks are checked against its weight before they are used: the model was filled with the blocks'
float32 dequantization, which is exact (a float16 scale times a code of at most 8 bits), so the two are equal bit
for bit, or the rows were not the layer's and it is quantized from its weight instead."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from tserve.model.block_quant import dequantize
from tserve.model.gguf.tensors import GGUFWeights

log = logging.getLogger("tserve.model.checkpoint")

_MAX_FUSED = 3  # parameters one layer made after loading may replace (the gate and up projections: 2)


class _RowIds:
    """A `WeightSource` whose tensors are `GGUFWeights.rows`: what the importer reads on its second run."""

    def __init__(self, weights: GGUFWeights) -> None:
        self._weights, self.file = weights, weights.file

    def names(self) -> list[str]:
        return self._weights.names()

    def __contains__(self, name: str) -> bool:
        return name in self._weights

    def __getitem__(self, name: str) -> Tensor:
        return self._weights.rows(name)

    def get(self, name: str) -> Tensor | None:
        return self[name] if name in self else None

    def strip_prefix(self, prefix: str) -> _RowIds:
        self._weights.strip_prefix(prefix)
        return self


class FileBlocks:
    """`given` for `quantize_blocks`: a linear layer of `model` (built from `weights` by `importer`, with `config`)
    -> its stored Q8_0 / Q4_0 codes, scales and format, or None (another type, or rows of mixed types: quantized
    from the weight). `any_format`: stored blocks are kept whichever of the two formats they are in (`--quantize
    auto`: the file as it is); else only those in the format the layer is to take (a format asked for by name is
    the one served: a Q8_0 file under `q4_0` is quantized again to Q4_0). `report()` logs, once, what was served
    from the file and what was quantized again."""

    def __init__(self, weights: GGUFWeights, importer: Any, config: Any, model: nn.Module,
                 any_format: bool = True) -> None:
        self._weights, self._any_format = weights, any_format
        rows = {name: ids for name, ids in importer.weights(config, _RowIds(weights)) if ids.dim() == 2}
        names: dict[int, list[str]] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):  # a tied output layer: two names
            names.setdefault(id(parameter), []).append(name)
        present = {name for aliases in names.values() for name in aliases}
        self._candidates: dict[int, list[Tensor]] = {}
        for module_name, linear in _linears(model):
            own = [rows[n] for n in names[id(linear.weight)] if n in rows]
            if own:
                self._candidates[id(linear.weight)] = own[:1]
                continue
            parent = module_name.rpartition(".")[0]
            replaced = [ids for n, ids in rows.items() if n not in present and n.rpartition(".")[0].rpartition(".")[0]
                        == parent and n.endswith(".weight")]
            if 1 < len(replaced) <= _MAX_FUSED:
                self._candidates[id(linear.weight)] = [torch.cat(order) for order in itertools.permutations(replaced)]
        self._served: Counter[str] = Counter()
        self._requantized: list[str] = []
        self._names = {id(linear.weight): name for name, linear in _linears(model)}

    def __call__(self, linear: nn.Linear, fmt: str) -> tuple[Tensor, Tensor, str] | None:
        weight = linear.weight.detach()
        for ids in self._candidates.get(id(linear.weight), []):
            # The first row alone first: it tells a fused layer's orders apart without reading the whole layer.
            if len(ids) == weight.size(0) and self._encode(ids[:1], weight[:1]) and \
                    (found := self._encode(ids, weight)) and (self._any_format or found[2] == fmt):
                self._served[found[2]] += 1
                return found
        self._requantized.append(self._names[id(linear.weight)])
        return None

    def _encode(self, ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, str] | None:
        """The stored blocks of `ids`, where they are exactly `rows` (the float weights they were dequantized to)."""
        found = self._weights.block_rows(ids)
        if found is None or found[0].size(1) != rows.size(1):
            return None
        return found if torch.equal(dequantize(*found), rows.float()) else None

    def report(self, path: object, fmt: str, types: dict[str, int]) -> None:
        log.info("GGUF Q8_0 / Q4_0 blocks served as they are; the other linear layers quantized from their "
                 "dequantized weights", extra={"path": str(path), "gguf_types": types, "quantization": fmt,
                                               "layers_from_blocks": dict(self._served),
                                               "layers_requantized": self._requantized})


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The layers `quantize_blocks` replaces, with their names."""
    return ((name, m) for name, m in model.named_modules() if type(m) is nn.Linear)

