"""One-token attention straight from the paged KV cache on the CPU: `paged_decode.cpp`, built on first use by
PyTorch's extension builder (g++, into `TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions; about 30 s
once, then loaded from there).

A decode step of `sdpa` first gathers every running row's self-attention blocks into one tensor (a copy of the
keys and values, every layer) and then runs PyTorch's CPU flash kernel, built for blocks of queries: with one
query per row it reads the copy at a third of the memory bandwidth (docs/BENCHMARKS.md). This kernel reads each
row's positions through its block table, all heads of a position as one contiguous run, in one pass over the keys
and one over the values: float32, one row at a time (a row's result does not depend on the batch).

It serves the `cpu-decode` attention backend (`model.attention`), what `auto` is on the CPU when it builds; where
it cannot be built (no compiler), `auto` is `sdpa` and a warning says why."""

from __future__ import annotations

import functools
import logging
import math
import platform
from pathlib import Path
from types import ModuleType

from torch import Tensor

log = logging.getLogger("tserve.kernels")

_SOURCE = Path(__file__).with_name("paged_decode.cpp")


@functools.cache
def _extension() -> ModuleType | None:
    """The built kernel, or None (logged once) where it cannot be built."""
    from torch.utils import cpp_extension  # noqa: PLC0415 (the builder, only when asked for)

    # AVX2 and FMA: every x86-64 CPU this serves has them; the loops vectorise to 8 floats.
    flags = ["-O3", "-fopenmp-simd"] + (["-mavx2", "-mfma"] if platform.machine() in ("x86_64", "AMD64") else [])
    try:
        return cpp_extension.load("tserve_paged_decode", [str(_SOURCE)], extra_cflags=flags, verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the `sdpa` path serves instead
        log.warning("the CPU decode attention kernel could not be built; decode steps use sdpa",
                    extra={"error": f"{type(exc).__name__}: {exc}"[:500]})
        return None


def available() -> bool:
    """Whether the kernel is built (building it now if needed)."""
    return _extension() is not None


def paged_decode(q: Tensor, k_blocks: Tensor, v_blocks: Tensor, tables: Tensor, lengths: Tensor,
                 bound: int | None = None) -> Tensor:
    """q (B, H, 1, D); k/v blocks (num_blocks, KV, block_len, D), views of the flat cache (positions, KV, D);
    tables (B, W) block ids; lengths (B,): row b attends over its positions [0, lengths[b]). -> (B, H, 1, D).
    (`bound`, an upper bound of the lengths, is for kernels that size their launch by it.)"""
    ext = _extension()
    if ext is None:
        raise RuntimeError("the CPU decode attention kernel is not built")
    B, H, _, D = q.shape
    block_len, KV = k_blocks.size(2), k_blocks.size(1)
    flat = lambda t: t.transpose(1, 2).reshape(-1, KV, D)  # noqa: E731 - the cache itself: a view, no copy
    out = ext.paged_decode(q.reshape(B, H, D).contiguous().float(), flat(k_blocks), flat(v_blocks),
                           tables, lengths, block_len, 1.0 / math.sqrt(D))
    return out.view(B, H, 1, D).to(q.dtype)
