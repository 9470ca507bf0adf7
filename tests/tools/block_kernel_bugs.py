"""Planted bugs of the Q8_0 / Q4_0 block kernels (`tserve/model/kernels/block_quant.cpp`) and the layer that picks
their path (`tserve/model/block_quant.py`); part of `tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

BITWISE = "tests/model/test_block_kernels.py::test_each_path_equals_the_statement_bitwise"
AVX512, AVX2 = (tuple(f"{BITWISE}[{isa}-{fmt}]" for fmt in ("q8_0", "q4_0")) for isa in ("avx512", "avx2"))

BLOCK_KERNEL_BUGS = [
    Bug("block-kernel-avx512-scale-of-the-next-block", "tserve/model/kernels/block_quant.cpp",
        "_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales + (b - p.b0) * kCols)));",
        "_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales + (std::min(b + 1, p.b1 - 1) - p.b0) * kCols)));",
        AVX512),
    Bug("block-kernel-avx2-scale-of-the-next-block", "tserve/model/kernels/block_quant.cpp",
        "_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + (b - p.b0) * kCols + 8 * half)));",
        "_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + (std::min(b + 1, p.b1 - 1) - p.b0) * kCols + 8 * half)));",
        AVX2),
    Bug("block-kernel-activations-truncated", "tserve/model/kernels/block_quant.cpp",
        "std::nearbyint(v[k] * inverse)", "std::trunc(v[k] * inverse)", AVX512 + AVX2),
    Bug("block-kernel-avx2-tail-skipped", "tserve/model/kernels/block_quant.cpp",
        "  if (cols <= 0) return;", "  if (cols < 8) return;", AVX2),
    Bug("block-kernel-path-ignores-pytorchs-capability", "tserve/model/block_quant.py",
        "if i in supported and capability in _CAPABILITIES[i]", "if i in supported",
        ("tests/model/test_block_kernels.py::test_the_path_follows_pytorchs_capability",)),
]
