"""How many KV-cache blocks a language model or a translator (its decoder rows and encoded sources) gets: `--kv-cache-memory` in bytes or as
a fraction of the memory free on the model's device, divided by what a block costs (every layer's keys and
values of its positions)."""

from __future__ import annotations

import torch

from tserve.model.checkpoint import LoadedModel
from tserve.model.window_blocks import WindowBlocks

DEFAULT_FRACTION = 0.4  # without --kv-cache-memory: room for every row's whole context, at most this much


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def kv_block_bytes(loaded: LoadedModel, block_size: int, layers: int | None = None) -> int:
    """What one block of the pool holds: keys and values of its positions in every layer that caches them (a
    translator's decoder layers; grouped-query models: their kv heads only), or in `layers` of them."""
    cfg = loaded.config
    if hasattr(cfg, "n_decoder_layers"):  # a translator: its decoder layers' self- and cross-attention (`Seq2Seq.new_cache`)
        all_layers, heads = cfg.n_decoder_layers, cfg.n_heads
    else:
        all_layers, heads = cfg.n_layers, cfg.kv_heads
    layers = all_layers if layers is None else layers
    return 2 * layers * heads * cfg.d_head * loaded.model.tok_emb.weight.element_size() * block_size


def kv_cache_blocks(loaded: LoadedModel, budget: tuple[int | None, float | None], block_size: int, rows: int,
                    row_blocks: int, least: int | None = None, *, layers: int | None = None, reserved: int = 0) -> int:
    """Blocks of the pool (the null block included) for `budget`: (bytes, None) or (None, a fraction of the free
    memory); (None, None): `row_blocks` (what a row takes at its longest) for every row, at most
    `DEFAULT_FRACTION` of the free memory. At least `least` blocks (default: one row's), or the model could not
    run. `layers`: the pool's blocks hold that many layers (default: every one); `reserved`: bytes of the budget
    spent elsewhere (the sliding layers' own pool)."""
    block_bytes = kv_block_bytes(loaded, block_size, layers)
    if block_bytes == 0:  # every layer keeps its keys in another pool: this one only names blocks, at no cost
        return 1 + rows * row_blocks
    size, fraction = budget
    if size is None and fraction is None:
        size = min(rows * row_blocks * block_bytes, int(DEFAULT_FRACTION * free_memory(loaded.device)) - reserved)
    elif size is None:
        size = int(fraction * free_memory(loaded.device)) - reserved
    else:
        size -= reserved
    return 1 + max(row_blocks if least is None else least, size // block_bytes)


def lm_kv_blocks(loaded: LoadedModel, budget: tuple[int | None, float | None], block_size: int, rows: int,
                 context: int, ahead: int = 0) -> tuple[int, int]:
    """A language model's (blocks of the pool its full-attention layers share, blocks of its sliding-window layers'
    own pool: 0 where it has none). The sliding layers' pool holds every row's window and one whole context
    (`WindowBlocks.pool_blocks`); the budget's rest goes to the other layers."""
    cfg = loaded.config
    window_blocks = 0
    if cfg.sliding_layers:
        window_blocks = WindowBlocks.pool_blocks(rows, context, cfg.sliding_window, block_size, ahead)
    sliding = len(cfg.sliding_layers) if window_blocks else 0  # (0 blocks: they stay with the others)
    reserved = window_blocks * kv_block_bytes(loaded, block_size, sliding)
    num_blocks = kv_cache_blocks(loaded, budget, block_size, rows, -(-context // block_size),
                                 layers=cfg.n_layers - sliding, reserved=reserved)
    return num_blocks, window_blocks
