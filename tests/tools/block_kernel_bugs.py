"""Planted bugs of the Q8_0 / Q4_0 block kernels (`tserve/model/kernels/block_quant.cpp`), the layer that picks
their path (`tserve/model/block_quant.py`) and the fused decode step (`tserve/model/kernels/decode_layers.cpp`,
`tserve/model/fused_decode.py`); part of `tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

BITWISE = "tests/model/test_block_kernels.py::test_each_path_equals_the_statement_bitwise"
AVX512, AVX2 = (tuple(f"{BITWISE}[{isa}-{fmt}]" for fmt in ("q8_0", "q4_0")) for isa in ("avx512", "avx2"))

FUSED = "tests/model/test_fused_decode.py::test_fused_steps_equal_the_layers_steps"

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
    Bug("fused-rope-position-off-by-one", "tserve/model/decoder.py",
        "x, rotary, local_rotary = self._embed(tokens[:, None], positions)",
        "x, rotary, local_rotary = self._embed(tokens[:, None], positions + 1)",
        (f"{FUSED}[llama-q8_0]", f"{FUSED}[qwen3-float32]")),
    Bug("fused-bias-on-the-next-column", "tserve/model/fused_decode.py",
        "    return _NONE if bias is None else bias.detach()",
        "    return _NONE if bias is None else bias.detach().roll(1)",
        (f"{FUSED}[qwen2-q4_0]", f"{FUSED}[gpt2-packed]")),
    Bug("fused-sliding-layers-rotate-with-the-global-tables", "tserve/model/kernels/decode_layers.cpp",
        "const bool local = cfg.has_local_rope && n[kWindow] > 0;", "const bool local = false;",
        (f"{FUSED}[gemma3-float32]",)),
    Bug("fused-residual-multiplier-dropped", "tserve/model/kernels/decode_layers.cpp",
        "x[i] += multiplier == 1.0f ? o[i] : o[i] * multiplier;", "x[i] += o[i];",
        (f"{FUSED}[phi3-smollm3-granite-q8_0]",)),
    Bug("fused-window-ignored", "tserve/model/kernels/decode_layers.cpp",
        "cfg.block_size, scale, n[kWindow]);", "cfg.block_size, scale, 0);",
        (f"{FUSED}[phi3-smollm3-granite-float32]", f"{FUSED}[gemma3-q4_0]")),
    Bug("fused-silu-lanes-take-the-sigmoid-of-minus-x", "tserve/model/kernels/vector_math.h",
        "_mm256_blendv_ps(one, e, x)", "_mm256_blendv_ps(e, one, x)",
        (f"{FUSED}[llama-float32]", f"{FUSED}[qwen2-q4_0]")),
    Bug("fused-gelu-tanh-lanes-lose-the-sign", "tserve/model/kernels/vector_math.h",
        "return _mm256_or_ps(magnitude, _mm256_and_ps(y, sign));", "return magnitude;",
        (f"{FUSED}[gpt2-float32]",)),
    Bug("dense-rows-drop-the-last-products", "tserve/model/kernels/dense_rows.cpp",
        "for (int64_t k = whole; k < K; ++k) total += w[r * K + k] * xm[k];", "",
        ("tests/model/test_dense_rows.py::test_equals_linear[3-37-13]",)),
    Bug("dense-rows-bias-on-the-next-column", "tserve/model/kernels/dense_rows.cpp",
        "total + bias[n0 + r] : total;", "total + bias[(n0 + r + 1) % N] : total;",
        ("tests/model/test_dense_rows.py::test_each_bias_is_added_to_its_own_column",
         "tests/model/test_dense_rows.py::test_equals_linear[1-576-960]")),
    Bug("fused-final-norm-skipped", "tserve/model/kernels/decode_layers.cpp",
        "  if (present(last[0])) {", "  if (false) {",
        (f"{FUSED}[llama-q8_0]", f"{FUSED}[gpt2-packed]")),
]
