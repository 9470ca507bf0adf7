"""The sliding-window layers' blocks (Gemma 2 / 3, Mistral's sliding layers): a pool of their own, from which a
sequence holds only the blocks its window still reaches.

A query at position p of a layer with window W reads positions p - W + 1 .. p. Such layers keep their keys and
values in a `PagedKVCache` of their own (`PagedKVCache.local`) whose blocks come from this pool: a sequence's table
here is indexed like its table in the full layers' pool (entry j holds positions j * bs ..), with the null block
where a block has been given back (`trim`, after every forward) or was never needed (a cached prefix's blocks
before its last window). Gemma 3 270M (15 sliding layers of 512 in 18) at a 32k context then holds 3 layers' worth
of keys and values per position, not 18.

While a prompt is computed, every block from its first query's window to its end is held (the forward writes them
all, and a query early in the prompt reads keys the window later leaves); `trim` gives them back right after. The
pool is sized for that (`pool_blocks`): every row's window, and one longest context besides.

Prefix caching: blocks are named as the full layers' are (the same chained hashes), and a trimmed block keeps its
name until its memory is taken. A cached prefix counts only as far as this pool still holds its last window
(`usable_prefix`): the full layers' hit is cut back to that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tserve.model.block_pool import NULL_BLOCK, BlockPool, BlockTable


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, *, prefix_caching: bool, salt: str) -> None:
        self.pool = BlockPool(num_blocks, block_size, prefix_caching=prefix_caching, salt=salt)
        self.block_size, self.window = block_size, window

    @staticmethod
    def pool_blocks(rows: int, context: int, window: int, block_size: int, ahead: int = 0) -> int:
        """Blocks (the null block included) for `rows` rows that each hold their window and up to `ahead` positions
        past their next one (speculative steps), and one `context`-long sequence being computed besides; 0 where
        that is no less than every row's whole context (one row, or a window as long as the context: Phi-4-mini's
        262,144 against its 131,072), and the sliding layers are better kept with the others."""
        per_row = -(-(window + ahead) // block_size) + 1  # + 1: a window need not start at a block's start
        whole = -(-context // block_size)
        need = rows * per_row + whole
        return 1 + need if need < rows * whole else 0

    def first_needed(self, position: int) -> int:
        """The first block read by a query at `position`, or any later one."""
        return max(0, position - self.window + 1) // self.block_size

    def usable_prefix(self, names: Sequence[bytes], token_ids: Sequence[int], hit: int) -> int:
        """The longest cached prefix, in blocks (at most `hit`, the full layers' hit), whose last window this pool
        still holds: a sequence sharing it computes its first new token with every layer's keys in place."""
        bs = self.block_size
        run = 0  # consecutive held blocks ending at block j
        runs = []
        for j in range(hit):
            held = self.pool.lookup(names[j], token_ids[j * bs:(j + 1) * bs]) is not None
            run = run + 1 if held else 0
            runs.append(run)
        for h in range(hit, 0, -1):
            if runs[h - 1] >= h - self.first_needed(h * bs):
                return h
        return 0

    def can_admit(self, num_tokens: int, hit: int) -> bool:
        """Whether a sequence of `num_tokens` whose first `hit` blocks are cached fits now (counting its cached
        blocks as taken from the free ones: an upper bound)."""
        return self.pool.blocks_for(num_tokens) - self.first_needed(hit * self.block_size) <= self.pool.num_free

    def admit(self, token_ids: Sequence[int], names: Sequence[bytes], hit: int) -> BlockTable:
        """A table for `token_ids` whose first `hit` blocks are cached (`usable_prefix`): the null block before
        their last window, those blocks shared, new ones for the rest (call `can_admit` first)."""
        bs, first = self.block_size, self.first_needed(hit * self.block_size)
        table = BlockTable([NULL_BLOCK] * first, list(names[:hit]), hit * bs)
        for j in range(first, hit):
            block = self.pool.lookup(names[j], token_ids[j * bs:(j + 1) * bs])
            assert block is not None, "usable_prefix promised this block"
            self.pool.acquire(block)
            table.blocks.append(block)
        if not self.pool.grow(table, len(token_ids)):
            self.release(table)
            raise RuntimeError(f"the sliding layers' KV cache has no room for {len(token_ids)} positions")
        return table

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Add blocks until `table` reaches `num_tokens` positions; False (nothing added) when too few are free."""
        return self.pool.grow(table, num_tokens)

    def computed(self, table: BlockTable, num_tokens: int, token_ids: Callable[[], Sequence[int]]) -> bool:
        """The first `num_tokens` positions are in the cache now (the next query is at the last's successor): name
        the full blocks of `token_ids()` (those of them known; asked for only when a block has filled since), then
        give back the blocks the next query's window no longer reaches. Returns whether the table changed."""
        if num_tokens // self.block_size > len(table.hashes):
            self.pool.name_full_blocks(table, token_ids())
        changed = False
        # The blocks held are a run at the table's end (the null block before them): walk back from the first
        # one still needed until the null block.
        for j in range(min(self.first_needed(num_tokens), len(table.blocks)) - 1, -1, -1):
            if table.blocks[j] == NULL_BLOCK:
                break
            self.pool.let_go(table.blocks[j])
            table.blocks[j] = NULL_BLOCK
            changed = True
        return changed

    def release(self, table: BlockTable) -> None:
        self.pool.release(table)
