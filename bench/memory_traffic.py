"""What a decode step's memory traffic is measured against: the machine's bandwidth (a STREAM-style triad and a
read-only pass) and the bytes one decode step of a language model reads. Shared by bench/roofline.py and
bench/load.py (which reports each run's fraction of the roofline)."""

from __future__ import annotations

import time


def bandwidth(threads: int, array_mb: int, repeats: int) -> tuple[float, float]:
    """(triad GB/s, read-only GB/s), best of `repeats`."""
    import torch

    torch.set_num_threads(threads)
    n = array_mb * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    triad, read = float("inf"), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        triad = min(triad, time.perf_counter() - start)
        start = time.perf_counter()
        b.sum()
        read = min(read, time.perf_counter() - start)
    return 3 * n * 4 / triad / 1e9, n * 4 / read / 1e9


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
