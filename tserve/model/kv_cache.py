"""Key/value caches: the paged cache of language models and of a translator's decoder, and a translator's
cross-attention keys/values in the same pool.

`PagedKVCache`: a pool of fixed-size blocks per layer; each row (a running sequence)
reads and writes its positions through its block table (`model.block_pool` decides who holds which block).
A forward builds one `PagedView` (where each new position is written, which positions each row reads) and
every layer uses it.

`PagedCrossKV` (encoder-decoder models): the cross-attention keys/values of each encoded source, written once per
source into blocks of the same pool as the decoder rows' (a block table per source slot).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tserve.model.device_inputs import to_device

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
                 device: torch.device | str | None = None, local_layers: Sequence[int] = (),
                 local_blocks: int = 0) -> None:
        super().__init__()
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)
        # Layer i's keys/values: (False, j) the j-th of this cache's; (True, j) the j-th of `local`'s, a cache of
        # its own for the sliding-window layers `local_layers`, whose rows hold only their window's blocks
        # (`model.window_blocks`; its tables are set apart from these).
        self.local: PagedKVCache | None = None
        full = [i for i in range(n_layers) if i not in set(local_layers)]
        self.layer_slots = [(False, full.index(i)) if i in full else (True, list(local_layers).index(i))
                            for i in range(n_layers)]
        if local_layers:
            if static_rows:
                raise ValueError("a cache with static rows keeps every layer's positions")
            self.local = PagedKVCache(len(local_layers), local_blocks, block_size, n_heads, d_head, num_rows=num_rows,
                                      max_len=max_len, dtype=dtype, device=device)
        shape = (len(full), num_blocks * block_size, n_heads, d_head)
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
            self.tables[to_device(index, self.tables.device)] = to_device(padded, self.tables.device)

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
        local = self.local.view(rows, positions, kv_len) if self.local is not None else None
        return PagedView(self, write.reshape(-1), read, read_start, kv_len, rows, positions, local)

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
        return 2 * self.k.numel() * self.k.element_size() + (self.local.nbytes() if self.local is not None else 0)

    def bytes_per_token(self) -> int:
        """Keys and values of one position in every layer: 2 x layers x kv heads x head size x dtype size (with
        `local`, the sliding layers' too: what a position costs while their windows hold it)."""
        layers, _, heads, d_head = self.k.shape
        local = self.local.k.size(0) if self.local is not None else 0
        return 2 * (layers + local) * heads * d_head * self.k.element_size()


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
    local: PagedView | None = None  # the same forward's in the sliding layers' own cache (`PagedKVCache.local`)

    def layer(self, index: int) -> PagedLayerKV:
        in_local, j = self.cache.layer_slots[index]
        if in_local:
            return self.local.layer(j)
        return PagedLayerKV(self, self.cache.k[j], self.cache.v[j])

    # What a decode kernel reads, the same in every layer: built once per forward, by its first layer.
    @functools.cached_property
    def row_tables(self) -> Tensor:
        return self.cache.tables[self.rows]  # (B, max_blocks)

    @functools.cached_property
    def lengths(self) -> Tensor:
        return self.positions[:, -1] + 1  # (B,) each row's positions [0, position] after this forward's


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

    def decode(self, kernel: CachedDecodeKernel, q: Tensor, window: int | None = None) -> Tensor:
        """One query per row over its own positions [0, position] (the last `window` of them if given: only
        kernels that take a window are handed one), read block by block by `kernel`."""
        bs = self.view.cache.block_size
        blocks = lambda t: t.view(-1, bs, *t.shape[1:]).transpose(1, 2)  # noqa: E731 (num_blocks, H, bs, D)
        args = (q, blocks(self.k_cache), blocks(self.v_cache), self.view.row_tables, self.view.lengths,
                self.view.kv_len)
        return kernel(*args, window=window) if window else kernel(*args)


class PagedCrossKV:
    """Cross-attention keys/values of encoded sources, in the blocks of a translator's `PagedKVCache`: the one pool
    its decoder rows draw from, so that `--kv-cache-memory` bounds both. Source slot s holds `lengths[s]` positions
    in the blocks of its table `tables[s]` (padded with the null block); they are written once, when the source is
    encoded, and read by every decoder step of the requests translating it.

    `static_from`: give slot s the blocks static_from + s * max_blocks ... for good (tests, scripts)."""

    def __init__(self, pool: PagedKVCache, num_slots: int, max_len: int, *, static_from: int | None = None) -> None:
        self.pool, self.max_len = pool, max_len
        self.max_blocks = -(-max_len // pool.block_size)
        tables = torch.zeros(num_slots, self.max_blocks, dtype=torch.long)
        if static_from is not None:
            if pool.num_blocks < static_from + num_slots * self.max_blocks:
                raise ValueError("too few blocks for static cross slots")
            tables += static_from + torch.arange(num_slots * self.max_blocks).view(num_slots, self.max_blocks)
        self.tables = tables.to(pool.k.device)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=pool.k.device)
        # On the CPU, the last read's copy: decoder steps read the same sources until a request starts or ends, and
        # a gather at every step would copy every source's keys and values again (~3 MB a layer for 32 sentences).
        # On CUDA (a gather is cheap there, and CUDA graphs replay it) each layer gathers its own when it attends.
        self.keep_reads = pool.k.device.type == "cpu"
        self._last_read: tuple[tuple[tuple[int, ...], int], list[tuple[Tensor, Tensor]]] | None = None

    @property
    def num_slots(self) -> int:
        return self.tables.size(0)

    def set_table(self, slot: int, blocks: list[int]) -> None:
        if len(blocks) > self.max_blocks:
            raise ValueError(f"a source holds at most {self.max_blocks} blocks")
        self.tables[slot] = torch.tensor(blocks + [0] * (self.max_blocks - len(blocks)), device=self.tables.device)
        self._last_read = None

    def write(self, slots: Tensor, kv: list[tuple[Tensor, Tensor]], lengths: Tensor) -> None:
        """Store every decoder layer's keys and values (B, H, T, D) of right-padded sources of `lengths` at
        positions 0..T-1 of `slots` (B,) (positions past a slot's table go to the null block)."""
        bs, T = self.pool.block_size, kv[0][0].size(2)
        t = torch.arange(T, device=slots.device)
        flat = (self.tables[slots][:, t // bs] * bs + t % bs).reshape(-1)
        for layer, (k, v) in enumerate(kv):
            H, D = k.size(1), k.size(3)
            for cache, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
                cache.index_copy_(0, flat, new.transpose(1, 2).reshape(-1, H, D).to(cache.dtype))
        self.lengths[slots] = lengths
        self._last_read = None

    def in_place(self, slots: Tensor) -> Callable[[int], PagedSourceKV]:
        """Layer i -> the sources of rows' `slots` (B,) as they lie in the pool, for a decode kernel that reads
        blocks itself (`PagedSourceKV`)."""
        tables, lengths = self.tables[slots], self.lengths[slots]
        return lambda layer: PagedSourceKV(self.pool.k[layer], self.pool.v[layer], tables, lengths,
                                           self.pool.block_size)

    def reader(self, slots: Tensor, length: int) -> Callable[[int], tuple[Tensor, Tensor]]:
        """Layer i -> its keys and values (U, H, length, D) of `slots` (U,), gathered by whole blocks. With
        `keep_reads` (the CPU) one copy for every layer, kept while the same slots are read; else each layer's own
        gather when it attends (inside a CUDA graph: the memory of one layer's copy, not of all)."""
        key = (tuple(slots.tolist()), length) if self.keep_reads else None
        if key is not None and self._last_read is not None and self._last_read[0] == key:
            return self._last_read[1].__getitem__
        bs, n = self.pool.block_size, -(-length // self.pool.block_size)
        blocks = self.tables[slots][:, :n].reshape(-1)
        L, _, H, D = self.pool.k.shape

        def gather(t: Tensor) -> Tensor:  # (..., positions, H, D) -> (..., U, H, length, D)
            out = t.view(*t.shape[:-3], -1, bs, H, D).index_select(-4, blocks)
            return out.view(*t.shape[:-3], slots.numel(), n * bs, H, D)[..., :length, :, :].transpose(-3, -2)

        if key is None:
            return lambda layer: (gather(self.pool.k[layer]), gather(self.pool.v[layer]))
        k, v = gather(self.pool.k).contiguous(), gather(self.pool.v).contiguous()  # read at every step: contiguous
        layers = [(k[i], v[i]) for i in range(L)]
        self._last_read = (key, layers)
        return layers.__getitem__


@dataclass
class PagedSourceKV:
    """One decoder layer's cross-attention keys/values of each row's source, left where they are in the pool's
    blocks: a decode kernel reads row b's `lengths[b]` positions through `tables[b]` (its source's table), so
    no step copies a source."""

    k_cache: Tensor  # (num_blocks * block_size, H, D)
    v_cache: Tensor
    tables: Tensor  # (B, max_blocks)
    lengths: Tensor  # (B,)
    block_size: int

    def decode(self, kernel: CachedDecodeKernel, q: Tensor) -> Tensor:
        """Each row's query (B, H, 1, D) over its source's positions."""
        blocks = lambda t: t.view(-1, self.block_size, *t.shape[1:]).transpose(1, 2)  # noqa: E731
        return kernel(q, blocks(self.k_cache), blocks(self.v_cache), self.tables, self.lengths, None)


@dataclass
class SharedSources:
    """Decoder rows grouped by the cross-attention slot they read (the beams of one request read one
    source). Cross-attention then reads each source once and attends with its rows as extra queries,
    where a per-row read copies every source's keys and values once per beam."""

    slots: Tensor  # (U,) the distinct cross slots, in order of first use
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
        return SharedSources(slots,
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
