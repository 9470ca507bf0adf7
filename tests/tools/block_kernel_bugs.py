"""Planted bugs of the Q8_0 / Q4_0 block kernels (`tserve/model/kernels/block_quant.cpp`), the layer that picks
their path (`tserve/model/block_quant.py`), the float32 decode product (`tserve/model/kernels/dense_rows.cpp`) and
the fused decode step (`tserve/model/kernels/decode_layers.cpp`, `tserve/model/fused_decode.py`); part of
`tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

BITWISE = "tests/model/test_block_kernels.py::test_each_path_equals_the_statement_bitwise"
AVX512, AVX2 = (tuple(f"{BITWISE}[{isa}-{fmt}]" for fmt in ("q8_0", "q4_0")) for isa in ("avx512", "avx2"))

FUSED = "tests/model/test_fused_decode.py::test_fused_steps_equal_the_layers_steps"
DENSE = "tests/model/test_dense_rows.py"

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
    Bug("block-kernel-avx2-q8-one-row-drops-the-activations-sign", "tserve/model/kernels/block_quant.cpp",
        "pairs = _mm256_maddubs_epi16(x_magnitude, _mm256_sign_epi8(signed_w, signed_x));",
        "pairs = _mm256_maddubs_epi16(x_magnitude, _mm256_sign_epi8(signed_w, signed_w));", (f"{BITWISE}[avx2-q8_0]",)),
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
        "  if (whole < t.K) step_avx2<R, C, true>(t, whole, acc, first_lanes(t.K - whole));", "",
        (f"{DENSE}::test_equals_linear[avx2-3-37-13]", f"{DENSE}::test_every_row_count_equals_linear[avx2-5]")),
    Bug("dense-rows-avx512-drop-the-last-products", "tserve/model/kernels/dense_rows.cpp",
        "  if (whole < t.K) step_avx512<R, C, true>(", "  if (false) step_avx512<R, C, true>(",
        (f"{DENSE}::test_equals_linear[avx512-3-37-13]", f"{DENSE}::test_every_row_count_equals_linear[avx512-5]")),
    Bug("dense-rows-bias-on-the-next-column", "tserve/model/kernels/dense_rows.cpp",
        "bias.has_value() ? bias->contiguous() :", "bias.has_value() ? bias->roll(-1).contiguous() :",
        (f"{DENSE}::test_each_bias_is_added_to_its_own_column", f"{DENSE}::test_equals_linear[avx2-1-576-960]",
         f"{DENSE}::test_equals_linear[avx512-1-576-960]")),
    Bug("dense-rows-avx512-last-input-row-reads-the-row-before", "tserve/model/kernels/dense_rows.cpp",
        "const __m512 xv = load_512<kMasked>(t.x + c * t.K + k, mask);",
        "const __m512 xv = load_512<kMasked>(t.x + (c == 7 ? 6 : c) * t.K + k, mask);",
        (f"{DENSE}::test_every_row_count_equals_linear[avx512-8]", f"{DENSE}::test_equals_linear[avx512-40-64-100]",
         f"{DENSE}::test_a_rows_result_is_the_same_alone_and_in_any_batch[avx512-8]")),
    Bug("dense-rows-avx2-last-input-row-reads-the-row-before", "tserve/model/kernels/dense_rows.cpp",
        "const __m256 xv = load(t.x + c * t.K);", "const __m256 xv = load(t.x + (c == 3 ? 2 : c) * t.K);",
        (f"{DENSE}::test_every_row_count_equals_linear[avx2-4]",
         f"{DENSE}::test_a_rows_result_is_the_same_alone_and_in_any_batch[avx2-17]")),
    Bug("dense-rows-path-ignores-pytorchs-capability", "tserve/model/kernels/dense_rows.cpp",
        'has_avx512() && at::get_cpu_capability() == "AVX512"', "has_avx512()",
        (f"{DENSE}::test_the_path_follows_pytorchs_capability",)),
    Bug("fused-final-norm-skipped", "tserve/model/kernels/decode_layers.cpp",
        "  if (present(last[0])) {", "  if (false) {",
        (f"{FUSED}[llama-q8_0]", f"{FUSED}[gpt2-packed]")),
]
