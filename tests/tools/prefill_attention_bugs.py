"""Planted bugs of the CPU attention kernel of whole sequences (`tserve/model/kernels/prefill_attention.cpp`, its
tiles `prefill_tiles.h`, `cpu-decode`'s choice of it in `tserve/model/attention.py` and a prompt after its cached
prefix read without a mask in `tserve/model/decoder.py`; docs/testing/fixed-defects.md); part of
`tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

KERNEL = "tserve/model/kernels/prefill_attention.cpp"
TILES = "tserve/model/kernels/prefill_tiles.h"
PREFILL = "tests/model/test_prefill_attention.py::"
FLOAT64 = f"{PREFILL}test_each_path_equals_attention_in_float64"
CHOICE = f"{PREFILL}test_cpu_decode_takes_a_prompts_attention_and_leaves_the_rest_to_sdpa"
MODEL = f"{PREFILL}test_a_models_prefill_and_its_next_steps_on_cpu_decode_equal_sdpa"
AFTER_PREFIX = f"{PREFILL}test_prompts_after_their_cached_prefixes_run_on_the_kernel_and_equal_sdpa"
OWN_STARTS = f"{PREFILL}test_rows_after_prefixes_of_their_own_lengths_each_attend_from_their_own_start"

PREFILL_ATTENTION_BUGS = [
    Bug("prefill-query-misses-its-own-key", KERNEL, "limit[r] = causal ? std::min(first[b] + t + 1, Tk) : Tk;",
        "limit[r] = causal ? std::min(first[b] + t, Tk) : Tk;", (FLOAT64, MODEL)),
    Bug("prefill-causal-offset-ignored", KERNEL, "limit[r] = causal ? std::min(first[b] + t + 1, Tk) : Tk;",
        "limit[r] = causal ? std::min(t + 1, Tk) : Tk;", (FLOAT64,)),
    Bug("prefill-every-row-starts-where-the-first-does", KERNEL, "      first[b] = sp[b];", "      first[b] = sp[0];",
        (OWN_STARTS,)),
    Bug("prefill-values-of-the-next-kv-head", KERNEL, "vp + b * v.stride(0) + g * v.stride(2), v.stride(1), D,",
        "vp + b * v.stride(0) + (g + 1) % KV * v.stride(2), v.stride(1), D,", (FLOAT64, MODEL)),
    Bug("prefill-query-heads-of-the-wrong-group", KERNEL, "for (int64_t h = g * group; h < (g + 1) * group; ++h, ++r)",
        "for (int64_t h = g; h < H; h += KV, ++r)", (FLOAT64, MODEL)),
    Bug("prefill-queries-not-scaled", KERNEL, "qs[r * D + d] = src[d] * static_cast<float>(scale);",
        "qs[r * D + d] = src[d];", (FLOAT64, MODEL)),
    Bug("prefill-interleaved-blocks-overlap", KERNEL, "return i % 2 == 0 ? i / 2 : n - 1 - i / 2;",
        "return i % 2 == 0 ? i / 2 : n - 1 - (i + 1) / 2;", (FLOAT64,)),
    Bug("prefill-row-tile-ends-at-its-first-rows-keys", TILES,
        "return block.limit[std::min(block.rows, (tile + 1) * kRows) - 1];", "return block.limit[tile * kRows];",
        (FLOAT64,)),
    Bug("prefill-value-sums-restart-each-run", TILES, "acc[i][c] = t0 == 0 ? zero() : load(out[i] + c * kW);",
        "acc[i][c] = zero();", (FLOAT64, MODEL)),
    Bug("prefill-softmax-sum-misses-the-tail", TILES, "    s[j] = std::exp(s[j] - best);\n    total += s[j];",
        "    s[j] = std::exp(s[j] - best);", (FLOAT64,)),
    Bug("prefill-later-keys-not-cleared", TILES, "  std::fill(s + len, s + end, 0.0f);\n", "", (FLOAT64,)),
    Bug("prefill-value-channels-past-the-first-run", TILES, "weigh_tile<R, 2>(p, lds, v + d, stride, t0, t1, out);",
        "weigh_tile<R, 2>(p, lds, v, stride, t0, t1, out);", (FLOAT64,)),
    Bug("prompt-after-a-prefix-keeps-its-mask", "tserve/model/decoder.py",
        'mask = None if self.blocks[0].attn.backend == "cpu-decode" else causal_mask(positions, kv_len)',
        "mask = causal_mask(positions, kv_len)", (AFTER_PREFIX,)),
    Bug("prefix-rows-start-where-the-first-row-does", "tserve/model/attention.py",
        "            starts = cache.view.positions[:, 0]", "            starts = cache.view.positions[:1, 0].expand(q.size(0))",
        (AFTER_PREFIX,)),
    Bug("prefix-rows-off-the-kernel-attend-from-the-end", "tserve/model/attention.py",
        "mask, is_causal = causal_from(starts, q.size(-2), k.size(-2), mask), False",
        "mask, is_causal = mask, True", (CHOICE,)),
    Bug("cpu-decode-prefill-ignores-a-mask", "tserve/model/attention.py",
        "    if mask is None and not dropout_p and not grads", "    if not dropout_p and not grads", (CHOICE,)),
    Bug("cpu-decode-prefill-without-gradients-while-training", "tserve/model/attention.py",
        "    if mask is None and not dropout_p and not grads", "    if mask is None and not dropout_p", (CHOICE,)),
]
