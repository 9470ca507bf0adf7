"""Key/value caches: the paged cache of language models, and the static cache of encoder-decoder models.

`PagedKVCache` (decoder-only models): a pool of fixed-size blocks per layer; each row (a running sequence)
reads and writes its positions through its block table (`model.block_pool` decides who holds which block).
A forward builds one `PagedView` (where each new position is written, which positions each row reads) and
every layer uses it.

`KVCache` (static): buffers have shape (n_layers, num_slots, n_heads, max_len, d_head) and are allocated once. A running
sequence owns a slot; new keys/values are written in place at (slot, position), so decode steps have
static shapes (CUDA-graph friendly) and slots are freed and reused independently. Encoder-decoder models
keep a second cache of the same kind for cross-attention keys/values, written once per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# (q (B, H, 1, D), k/v blocks (num_blocks, H, block_len, D), block tables (B, W), lengths (B,), bound) -> (B, H, 1, D)
CachedDecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int | None], Tensor]


class PagedKVCache(nn.Module):
    """Keys/values of `num_blocks` blocks of `block_size` positions in every layer, stored flat as
    (n_layers, num_blocks * block_size, kv heads, d_head): position p of block b is row b * block_size + p, so a
    forward writes its new positions with one `index_copy_` and reads a row's blocks with one `index_select`.

    `tables` (num_rows + 1, max_blocks) holds each row's block table on the model's device (padded with the
    null block 0); the last row belongs to nobody (padding rows of CUDA-graph buckets). `static_rows`: give
    row r the blocks 1 + r * max_blocks ... for good, which makes the cache a static one (tests, scripts).
    """

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_heads: int, d_head: int, *,
                 num_rows: int, max_len: int, static_rows: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)
        shape = (n_layers, num_blocks * block_size, n_heads, d_head)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        tables = torch.zeros(num_rows + 1, self.max_blocks, dtype=torch.long)
        if static_rows:
            if num_blocks < 1 + num_rows * self.max_blocks:
                raise ValueError("too few blocks for static rows")
            tables[:num_rows] = 1 + torch.arange(num_rows * self.max_blocks).view(num_rows, self.max_blocks)
        self.register_buffer("tables", tables.to(device), persistent=False)
        self._host_tables = tables  # the same, on the host: CPU views are planned from it without a sync

    @property
    def num_blocks(self) -> int:
        return self.k.size(1) // self.block_size

    @property
    def num_rows(self) -> int:
        return self.tables.size(0) - 1

    @property
    def max_len(self) -> int:
        return self.max_blocks * self.block_size

    def set_table(self, row: int, blocks: list[int]) -> None:
        """Point `row` at `blocks` (the rest of its table at the null block)."""
        self.set_tables([row], [blocks])

    def set_tables(self, rows: list[int], tables: list[list[int]]) -> None:
        """`set_table` for several rows at once (one tensor built, one copy to the device)."""
        if not rows:
            return
        if max(len(t) for t in tables) > self.max_blocks:
            raise ValueError(f"a row holds at most {self.max_blocks} blocks")
        padded = torch.tensor([t + [0] * (self.max_blocks - len(t)) for t in tables], dtype=torch.long)
        index = torch.tensor(rows)
        self._host_tables[index] = padded
        if self.tables.device.type != "cpu":  # on the CPU `tables` is this very tensor
            self.tables[index.to(self.tables.device)] = padded.to(self.tables.device)

    def copy_positions(self, copies: list[tuple[int, int, int]]) -> None:
        """For each (source block, destination block, n): copy the first n positions (every layer), the part of a
        forked table's last block written so far (copy-on-write)."""
        if not copies:
            return
        bs = self.block_size
        src = [b * bs + i for b, _, n in copies for i in range(n)]
        dst = [b * bs + i for _, b, n in copies for i in range(n)]
        s, d = (torch.tensor(x, device=self.k.device) for x in (src, dst))
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]

    def view(self, rows: Tensor, positions: Tensor, kv_len: int | None) -> PagedView:
        """The plan of one forward: `rows` (B,) write their new tokens at `positions` (B, T) and, unless `kv_len`
        is None (a prefill from position 0: attend over the new keys only), read positions [0, kv_len)."""
        bs = self.block_size
        tables = self.tables[rows]  # (B, max_blocks)
        write = tables.gather(1, (positions // bs).clamp_max(self.max_blocks - 1)) * bs + positions % bs
        write = torch.where(positions < self.max_len, write, positions % bs)  # past the table: the null block
        read_start = read = None
        if kv_len is not None:
            read_start = self._contiguous_start(rows, kv_len)
            if read_start is None:
                read = tables[:, : -(-kv_len // bs)]
        return PagedView(self, write.reshape(-1), read, read_start, kv_len, rows, positions)

    def _contiguous_start(self, rows: Tensor, kv_len: int) -> int | None:
        """On the CPU, for one row whose first `kv_len` positions lie in consecutive blocks: where they start, so
        that they are read through a slice instead of a gather."""
        if rows.device.type != "cpu" or rows.numel() != 1:
            return None
        n = -(-kv_len // self.block_size)
        blocks = self._host_tables[int(rows[0]), :n]
        first = int(blocks[0])
        if first == 0 or not torch.equal(blocks, torch.arange(first, first + n)):
            return None
        return first * self.block_size

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_per_token(self) -> int:
        """Keys and values of one position in every layer: 2 x layers x kv heads x head size x dtype size."""
        layers, _, heads, d_head = self.k.shape
        return 2 * layers * heads * d_head * self.k.element_size()


@dataclass
class PagedView:
    """One forward's reads and writes of a `PagedKVCache` (shared by every layer)."""

    cache: PagedKVCache
    write: Tensor  # (B * T,) flat cache positions of the new tokens
    read: Tensor | None  # (B, n) the blocks holding each row's positions [0, kv_len); None: a slice or the new keys
    read_start: int | None  # one row whose positions are consecutive from here: read through a slice
    kv_len: int | None
    rows: Tensor  # (B,)
    positions: Tensor  # (B, T)

    def layer(self, index: int) -> PagedLayerKV:
        return PagedLayerKV(self, self.cache.k[index], self.cache.v[index])


@dataclass
class PagedLayerKV:
    view: PagedView
    k_cache: Tensor  # (num_blocks * block_size, H, D)
    v_cache: Tensor

    @property
    def kv_len(self) -> int | None:
        return self.view.kv_len

    def store(self, k: Tensor, v: Tensor) -> None:
        """Write the new keys/values (B, H, T, D) at the view's positions."""
        H, D = k.size(1), k.size(3)
        self.k_cache.index_copy_(0, self.view.write, k.transpose(1, 2).reshape(-1, H, D).to(self.k_cache.dtype))
        self.v_cache.index_copy_(0, self.view.write, v.transpose(1, 2).reshape(-1, H, D).to(self.v_cache.dtype))

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.store(k, v)
        view = self.view
        if view.kv_len is None:
            return k, v
        if view.read_start is not None:
            span = slice(view.read_start, view.read_start + view.kv_len)
            return self.k_cache[span][None].transpose(1, 2), self.v_cache[span][None].transpose(1, 2)
        # Whole blocks are gathered (copies of block_size positions each: ~3x faster than position by position on
        # a CPU), then each row's first kv_len positions viewed.
        B, n = view.read.shape
        bs, L = view.cache.block_size, view.kv_len
        blocks = view.read.reshape(-1)
        k_read = self.k_cache.view(-1, bs, *self.k_cache.shape[1:]).index_select(0, blocks)
        v_read = self.v_cache.view(-1, bs, *self.v_cache.shape[1:]).index_select(0, blocks)
        k_read = k_read.view(B, n * bs, *self.k_cache.shape[1:])[:, :L]
        v_read = v_read.view(B, n * bs, *self.v_cache.shape[1:])[:, :L]
        return k_read.transpose(1, 2), v_read.transpose(1, 2)  # (B, H, L, D)

    def decode(self, kernel: CachedDecodeKernel, q: Tensor) -> Tensor:
        """One query per row over its own positions [0, position], read block by block by `kernel`."""
        bs = self.view.cache.block_size
        blocks = lambda t: t.view(-1, bs, *t.shape[1:]).transpose(1, 2)  # noqa: E731 (num_blocks, H, bs, D)
        lengths = self.view.positions[:, -1] + 1
        return kernel(q, blocks(self.k_cache), blocks(self.v_cache), self.view.cache.tables[self.view.rows],
                      lengths, self.view.kv_len)


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

    def view(self, slots: Tensor, positions: Tensor, kv_len: int | None) -> StaticView:
        """Every layer's view for one forward (the interface `PagedKVCache.view` shares)."""
        first_slot = consecutive_start(slots) if kv_len is not None else None
        return StaticView(self, slots, positions, kv_len, first_slot)

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
class StaticView:
    cache: KVCache
    slots: Tensor
    positions: Tensor
    kv_len: int | None
    first_slot: int | None

    def layer(self, index: int) -> LayerKV:
        return self.cache.layer(index, self.slots, self.positions, self.kv_len, self.first_slot)


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

    def decode(self, kernel: CachedDecodeKernel, q: Tensor) -> Tensor:
        """One query per row over [0, position] of its own slot: a slot is one block of the whole cache length."""
        return kernel(q, self.k_cache, self.v_cache, self.slots[:, None], self.positions[:, -1] + 1, self.kv_len)


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
