"""What a decode step's memory traffic is measured against: the machine's bandwidth (a STREAM-style triad and a
read-only pass), the rate our Q4_0 kernel reads one product far larger than the caches at, where two cores sit
(a cache line's round trip between them), and the bytes one decode step of a language model reads. Shared by
bench/roofline.py and bench/load.py (which reports each run's fraction of the roofline)."""

from __future__ import annotations

import time


def bandwidth(threads: int, array_mb: int, repeats: int) -> tuple[float, float]:
    """(triad GB/s, read-only GB/s), best of `repeats`."""
    import torch

    torch.set_num_threads(threads)
    n = array_mb * 2**20 // 4
    # Filled, not drawn: a triad's rate does not depend on the values, and torch.rand on one thread takes seconds.
    a, b, c = torch.empty(n), torch.full((n,), 1.0), torch.full((n,), 2.0)
    triad, read = float("inf"), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        triad = min(triad, time.perf_counter() - start)
        start = time.perf_counter()
        b.sum()
        read = min(read, time.perf_counter() - start)
    return 3 * n * 4 / triad / 1e9, n * 4 / read / 1e9


def product_bandwidth(threads: int, array_mb: int, repeats: int) -> float | None:
    """GB/s at which our kernels read the weights of one Q4_0 product of one row, `array_mb` of them (4096 inputs;
    best of `repeats`; the codes' values change no step of the kernel, so every block is alike): a decode step's
    products at their best, each thread streaming one contiguous chunk with no other loop between. None where the
    block kernels do not run."""
    import torch

    from tserve.model.kernels import cpu as cpu_kernels

    isa = cpu_kernels.kernel_isa()
    if isa is None:
        return None
    torch.set_num_threads(threads)
    k, block_bytes = 4096, 16 * 16  # 16 columns of a panel, 16 bytes of nibbles each a block
    blocks = k // 32
    panels = max(1, array_mb * 2**20 // (blocks * (block_bytes + 32)))
    codes = torch.full((panels, blocks, block_bytes), 0x5A, dtype=torch.uint8)  # written: every page is real
    scales = torch.full((panels, blocks, 16), 0.01, dtype=torch.float16)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    ext, best = cpu_kernels.extension(), float("inf")
    for _ in range(repeats + 1):  # the first call pages the output in
        start = time.perf_counter()
        ext.block_linear(x, codes, scales, None, panels * 16, 1, isa)
        best = min(best, time.perf_counter() - start)
    return (codes.numel() + scales.numel() * 2) / best / 1e9


def core_round_trip_ns() -> float | None:
    """ns for a cache line from one of this process's first two CPUs to the other and back (None: one CPU, or no
    kernels). On a VM the same two vCPUs may sit on one CCD (~50-100 ns) or on two (~200-400 ns), and with them
    the triad moves (two CCDs: two paths to memory)."""
    from tserve.model.kernels import cpu as cpu_kernels

    ext = cpu_kernels.extension()
    ns = ext.core_round_trip_ns(20000, 3) if ext is not None else -1.0
    return ns if ns > 0 else None


def step_bytes(loaded, context: int) -> tuple[int, int]:  # noqa: ANN001 - a LoadedModel
    """(weight bytes, KV bytes) one decode step reads at `context` positions."""
    import torch

    from tserve.model.block_quant import BlockLinear
    from tserve.model.packed_linear import PackedLinear
    from tserve.model.quantize import Int4Linear, Int8Linear

    cfg, model = loaded.config, loaded.model
    weights, head = 0, False
    for module in model.modules():
        if isinstance(module, PackedLinear):
            size = module.in_features * module.out_features * 4
        elif isinstance(module, (Int4Linear, BlockLinear)):  # packed codes and their scales (and zeros)
            size = module.weight_bytes()
        elif isinstance(module, Int8Linear):  # int8 weights, a scale and a row sum per output
            size = module.in_features * module.out_features + module.out_features * 8
        elif isinstance(module, torch.nn.Linear):
            size = module.weight.numel() * module.weight.element_size()
        elif isinstance(module, torch.nn.Embedding) or list(module.children()):
            continue
        else:  # norms: their own parameters
            weights += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            continue
        weights += size + (module.bias.numel() * 4 if getattr(module, "bias", None) is not None else 0)
        head = head or module.out_features == cfg.vocab_size
    if not head:  # the output layer is the embedding table, read whole
        weights += cfg.vocab_size * cfg.d_model * loaded.dtype.itemsize
    kv = 2 * cfg.n_layers * cfg.kv_heads * cfg.d_head * context * loaded.dtype.itemsize
    return weights, kv
