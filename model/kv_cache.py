"""Static, preallocated key/value cache.

Buffers have shape (n_layers, num_slots, n_heads, max_len, d_head) and are allocated once. A running
sequence owns a slot; new keys/values are written in place at (slot, position), so decode steps have
static shapes (CUDA-graph friendly) and slots are freed and reused independently. Encoder-decoder models
keep a second cache of the same kind for cross-attention keys/values, written once per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """Per-layer key/value buffers for `num_slots` sequences of up to `max_len` positions."""

    def __init__(
        self,
        n_layers: int,
        num_slots: int,
        n_heads: int,
        max_len: int,
        d_head: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (n_layers, num_slots, n_heads, max_len, d_head)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # Valid length of each slot: bookkeeping for callers (masks, cross-attention source lengths).
        self.register_buffer("lengths", torch.zeros(num_slots, dtype=torch.long, device=device), persistent=False)

    @property
    def num_slots(self) -> int:
        return self.k.size(1)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    def layer(self, index: int, slots: Tensor, positions: Tensor, kv_len: int | None,
              first_slot: int | None = None) -> LayerKV:
        """Layer `index`'s view for one forward. `first_slot`: `consecutive_start(slots)`, which callers
        work out once per forward, not once per layer."""
        return LayerKV(self.k[index], self.v[index], slots, positions, kv_len, first_slot)

    def write(self, index: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store whole sequences (B, H, T, D) at positions 0..T-1 of `slots` (cross-attention K/V)."""
        T = k.size(2)
        self.k[index, slots, :, :T] = k
        self.v[index, slots, :, :T] = v

    def read(self, index: int, slots: Tensor, length: int, first_slot: int | None = None) -> tuple[Tensor, Tensor]:
        """(B, H, length, D) keys and values of `slots`: a view when they are consecutive from `first_slot`
        (`consecutive_start(slots)`), else a gather."""
        if first_slot is not None:
            rows = slice(first_slot, first_slot + slots.numel())
            return self.k[index, rows, :, :length], self.v[index, rows, :, :length]
        return self.k[index, slots, :, :length], self.v[index, slots, :, :length]

    def copy_slots(self, src: Tensor, dst: Tensor, length: int | None = None) -> None:
        """Copy slots (every layer) from `src` to `dst`, e.g. to reorder beams by their parents: the first
        `length` positions (default: all), which is all a slot filled so far holds. Reads all sources before
        writing, so `src` and `dst` may overlap."""
        n = self.max_len if length is None else length
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = self.lengths[src]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_per_token(self) -> int:
        """Keys and values of one position in every layer: 2 x layers x kv heads x head size x dtype size."""
        layers, _, heads, _, d_head = self.k.shape
        return 2 * layers * heads * d_head * self.k.element_size()


@dataclass
class LayerKV:
    """One layer's view of the cache for one forward: writes new keys/values of `slots` at
    `positions` (B, T) and returns the keys/values the queries attend over."""

    k_cache: Tensor  # (num_slots, H, max_len, D)
    v_cache: Tensor
    slots: Tensor  # (B,)
    positions: Tensor  # (B, T)
    kv_len: int | None  # None: attend over the new keys only (prefill from an empty slot)
    first_slot: int | None = None  # set when `slots` are consecutive: the cache is read through a view

    def store(self, k: Tensor, v: Tensor) -> None:
        """Write the new keys/values (B, H, T, D) of `slots` at `positions`."""
        rows = self.slots[:, None].expand_as(self.positions)
        # Advanced indices (rows, positions) around a slice put the indexed dims first: (B, T, H, D).
        self.k_cache[rows, :, self.positions] = k.transpose(1, 2).to(self.k_cache.dtype)
        self.v_cache[rows, :, self.positions] = v.transpose(1, 2).to(self.v_cache.dtype)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.store(k, v)
        if self.kv_len is None:
            return k, v
        if self.first_slot is not None:  # a view instead of a gathered copy
            rows = slice(self.first_slot, self.first_slot + self.slots.numel())
            return self.k_cache[rows, :, : self.kv_len], self.v_cache[rows, :, : self.kv_len]
        return self.k_cache[self.slots, :, : self.kv_len], self.v_cache[self.slots, :, : self.kv_len]


def consecutive_start(slots: Tensor) -> int | None:
    """The first slot when `slots` are s, s+1, ... on the CPU. Reading the cache through a slice then costs
    nothing, where a gather copies every key and value. (On CUDA the gather stays: it needs no host sync
    and keeps shapes static for CUDA graphs.)"""
    if slots.device.type != "cpu":
        return None
    values = slots.tolist()
    return values[0] if values == list(range(values[0], values[0] + len(values))) else None


@dataclass
class SharedSources:
    """Decoder rows grouped by the cross-attention slot they read (the beams of one request read one
    source). Cross-attention then reads each source once and attends with its rows as extra queries,
    where a per-row read copies every source's keys and values once per beam."""

    slots: Tensor  # (U,) the distinct cross slots, in order of first use
    first_slot: int | None  # `consecutive_start(slots)`
    query_rows: Tensor  # (U, G) the rows of each source; B (one padding query) where a source has fewer
    row_positions: Tensor  # (B,) each row's place in the flattened (U * G) queries

    @staticmethod
    def of(cross_slots: Tensor) -> SharedSources | None:
        """The grouping of `cross_slots` (B,) when some rows share a source, on the CPU; else None (each row
        reads its own source; on CUDA a gather keeps shapes static for CUDA graphs)."""
        if cross_slots.device.type != "cpu":
            return None
        rows_of: dict[int, list[int]] = {}
        for row, slot in enumerate(cross_slots.tolist()):
            rows_of.setdefault(slot, []).append(row)
        n_rows = cross_slots.numel()
        if len(rows_of) == n_rows:
            return None
        width = max(len(rows) for rows in rows_of.values())
        positions = [0] * n_rows
        for u, rows in enumerate(rows_of.values()):
            for g, row in enumerate(rows):
                positions[row] = u * width + g
        slots = torch.tensor(list(rows_of))
        return SharedSources(slots, consecutive_start(slots),
                             torch.tensor([rows + [n_rows] * (width - len(rows)) for rows in rows_of.values()]),
                             torch.tensor(positions))


class SlotAllocator:
    """Free list of cache slots; the lowest free slot is handed out first (deterministic)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} cache slots, {len(self._free)} free")
        self._free.sort()
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if s in self._free or not 0 <= s < self.num_slots:
                raise RuntimeError(f"slot {s} freed twice or out of range")
        self._free.extend(slots)
