"""Who owns which block of the paged KV cache (host-side bookkeeping; the tensors are `PagedKVCache`'s).

The cache is a pool of `num_blocks` blocks of `block_size` positions. A sequence holds a `BlockTable`: the
blocks that hold its positions 0, bs, 2*bs, ... in order. Block 0 is the null block: it belongs to no one,
padding positions and padding rows write there, and nothing real reads it.

Prefix caching. A full block is named by a hash of its tokens chained with the hash of the block before it
(and a salt: whatever else changes the cache, e.g. the model and its dtype), so a name stands for the whole
prefix up to the block's end. A new sequence maps its longest named prefix onto its table (each block's
reference count goes up) and computes only the rest. A block whose count falls to zero is free but keeps
its name: it is found again until its memory is taken for another block, least recently freed first (LRU).

A block's life: free (in `_free`, maybe named) -> held by one or more tables (count > 0; a named block is
never written again, a table's last, partial block is its own) -> free again when the last table lets go.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0


@dataclass
class BlockTable:
    """One sequence's blocks, and the names of its full blocks so far (`hashes[i]` names `blocks[i]`)."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0  # positions found in the prefix cache when the sequence was admitted


def block_hash(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: its tokens chained with the name of the block before it."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, salt: str = "") -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least two blocks (one is the null block)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.salt = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self._refs = [0] * num_blocks
        self._name: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # a named block's tokens (checked on a hit)
        self._by_name: dict[bytes, int] = {}
        # Free blocks, the next to be taken first: unnamed ones at the front, named ones in the order freed.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(1, num_blocks))

    # ----------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (named free blocks included: they are given up on demand)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_in_use(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a named prefix."""
        return sum(1 for b in self._free if self._name[b] is not None)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------------------------------------
    def prefix_names(self, token_ids: Sequence[int]) -> list[bytes]:
        """The names of the full blocks of `token_ids` but its last token (its logits are the point of a prefill,
        so it is always computed)."""
        names: list[bytes] = []
        previous, bs = self.salt, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            previous = block_hash(previous, token_ids[i * bs:(i + 1) * bs])
            names.append(previous)
        return names

    def cached_prefix(self, token_ids: Sequence[int], most: int | None = None) -> tuple[list[int], list[bytes]]:
        """The longest run of named blocks (at most `most`) that starts `token_ids` (see `prefix_names`), and their
        names. Takes nothing."""
        if not self.prefix_caching:
            return [], []
        blocks: list[int] = []
        names = self.prefix_names(token_ids)[:most]
        bs = self.block_size
        for i, name in enumerate(names):
            block = self.lookup(name, token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        return blocks, names[: len(blocks)]

    def lookup(self, name: bytes, tokens: Sequence[int]) -> int | None:
        """The block named `name` if it still holds `tokens` (a name is a hash: the tokens are checked too)."""
        block = self._by_name.get(name)
        return block if block is not None and self._tokens[block] == tuple(tokens) else None

    def can_admit(self, token_ids: Sequence[int], reserve: int = 0, most: int | None = None) -> bool:
        """Whether a sequence of `token_ids` fits now with `reserve` blocks left over (sharing at most `most` cached
        blocks)."""
        hits, _ = self.cached_prefix(token_ids, most)
        taken_from_free = sum(1 for b in hits if self._refs[b] == 0)
        return self.blocks_for(len(token_ids)) - len(hits) + taken_from_free + reserve <= self.num_free

    def admit(self, token_ids: Sequence[int], most: int | None = None) -> BlockTable:
        """A table for `token_ids`: its cached prefix (at most `most` blocks of it) shared, new blocks for the rest
        (call `can_admit` first)."""
        hits, names = self.cached_prefix(token_ids, most)
        for block in hits:
            self.acquire(block)
        table = BlockTable(list(hits), list(names), len(hits) * self.block_size)
        if not self.grow(table, len(token_ids)):
            self.release(table)
            raise RuntimeError(f"the KV cache has no room for {len(token_ids)} positions")
        return table

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Add blocks until `table` holds `num_tokens` positions; False (and nothing added) when too few are free."""
        need = self.blocks_for(num_tokens) - len(table.blocks)
        if need > len(self._free):
            return False
        for _ in range(need):
            table.blocks.append(self._take())
        return True

    def name_full_blocks(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """Name the blocks of `table` that `token_ids` (positions already in the cache) fill, so that later
        sequences find them. A block whose content another block already names stays unnamed."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.hashes), len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            name = block_hash(table.hashes[-1] if table.hashes else self.salt, tokens)
            table.hashes.append(name)
            block = table.blocks[i]
            if block != NULL_BLOCK and name not in self._by_name and self._name[block] is None:
                self._by_name[name], self._name[block], self._tokens[block] = block, name, tokens

    def fork(self, table: BlockTable, num_tokens: int) -> tuple[BlockTable, tuple[int, int, int] | None]:
        """Another sequence's copy of the first `num_tokens` positions of `table` (a beam taking its parent's
        cache): its full blocks shared (never written again), its last, partial block copied into a block of the
        new table's own, since both go on writing into it (copy-on-write). Returns the new table and the (source
        block, destination block, positions written) the caller copies, if any."""
        shared = num_tokens // self.block_size
        forked = BlockTable(list(table.blocks[:shared]))
        for block in forked.blocks:
            self.acquire(block)
        if len(forked.blocks) * self.block_size >= num_tokens:
            return forked, None
        forked.blocks.append(self._take())
        return forked, (table.blocks[len(forked.blocks) - 1], forked.blocks[-1], num_tokens % self.block_size)

    def release(self, table: BlockTable) -> None:
        """Let go of every block of `table` (last first, so that a prefix's tail is evicted before its head)."""
        for block in reversed(table.blocks):
            self.let_go(block)
        table.blocks.clear()
        table.hashes.clear()

    def let_go(self, block: int) -> None:
        """One holder fewer for `block` (the null block, which no one holds, is passed over)."""
        if block == NULL_BLOCK:
            return
        self._refs[block] -= 1
        if self._refs[block] < 0:
            raise RuntimeError(f"KV block {block} released more often than taken")
        if self._refs[block] == 0:
            self._free[block] = None
            if self._name[block] is None:
                self._free.move_to_end(block, last=False)  # holds nothing worth keeping: taken first

    # ----------------------------------------------------------------------------------------------
    def acquire(self, block: int) -> None:
        """One holder more for `block` (a shared prefix's)."""
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _take(self) -> int:
        """A free block for new content: its old name (if any) is forgotten."""
        block, _ = self._free.popitem(last=False)
        name = self._name[block]
        if name is not None:
            if self._by_name.get(name) == block:
                del self._by_name[name]
            self._name[block] = self._tokens[block] = None
        self._refs[block] = 1
        return block

    def refs(self, block: int) -> int:
        return self._refs[block]
