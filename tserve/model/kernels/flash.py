"""Our FlashAttention kernels, written in Triton.

Two kernels, both computing softmax(q k^T / sqrt(d)) v in float32 without materialising the scores:

- `flash_attention` (prefill, encoder, cross-attention): tiles of BLOCK_M queries stream over BLOCK_N keys
  with the online softmax. Causal masking is aligned bottom-right (queries are the last Tq of Tk positions,
  as everywhere in this package); an optional boolean mask broadcastable to (B, H, Tq, Tk) covers key
  padding and anything else. Key blocks past the causal diagonal are never loaded.
- `flash_decode` (one new token per running sequence): reads each sequence's keys straight from its
  KV-cache slot up to that sequence's own length, so a short sequence batched beside a long one costs
  only its own length, not the padded one. Long caches are split over `num_splits` programs per head
  (split-K, "flash-decoding"), and a second kernel merges the partial softmaxes.

They are the `flash` backend of `model.attention`. They run on CUDA; with `TRITON_INTERPRET=1` Triton's
interpreter runs the same kernels on CPU tensors (slowly), which is how the test suite checks them on
machines without a GPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(*tensors: Tensor) -> None:
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise ValueError("the flash attention kernels run on CUDA tensors only; use 'sdpa' or 'math' on CPU")


def _head_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


# --------------------------------------------------------------------------------------------------
# Prefill / encoder: tiled attention with the online softmax
# --------------------------------------------------------------------------------------------------
@triton.jit
def _flash_fwd_kernel(
    Q, K, V, Out, Mask,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_ob, s_oh, s_om, s_od,
    s_mb, s_mh, s_mm, s_mn,
    H, Tq, Tk, D, qk_scale,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)  # (batch x heads) on the first grid axis, which has no 65,535 limit
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Tq
    d_ok = offs_d < D

    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    offset = Tk - Tq  # query i sits at key position i + offset
    hi = Tk
    if IS_CAUSAL:
        hi = tl.minimum(Tk, (pid_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < Tk
        k = tl.load(K + b * s_kb + h * s_kh + cols[None, :] * s_kn + offs_d[:, None] * s_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # (D, N)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # log2 domain
        allowed = col_ok[None, :] & row_ok[:, None]
        if IS_CAUSAL:
            allowed = allowed & (cols[None, :] <= offs_m[:, None] + offset)
        if HAS_MASK:
            mk = tl.load(Mask + b * s_mb + h * s_mh + offs_m[:, None] * s_mm + cols[None, :] * s_mn,
                         mask=row_ok[:, None] & col_ok[None, :], other=0)
            allowed = allowed & (mk != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * s_vb + h * s_vh + cols[:, None] * s_vn + offs_d[None, :] * s_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # (N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # Rows that may attend to nothing (fully masked) come out as zeros.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0
) -> tuple[Tensor, None]:
    """q (B, H, Tq, D), k/v (B, H, Tk, D); mask boolean, broadcastable to (B, H, Tq, Tk), True = may attend.
    Same contract as the other backends of `model.attention` (no weights are returned)."""
    if dropout_p > 0:
        raise ValueError("the flash kernels do not implement attention dropout (an inference kernel)")
    _check_device(q, k, v)
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    out = torch.empty_like(q)
    if Tq == 0:
        return out, None
    if mask is not None:
        # uint8 with stride 0 over broadcast dimensions: no (B, H, Tq, Tk) copy for a padding mask.
        mask = mask.to(torch.uint8).expand(B, H, Tq, Tk)
        mask_strides = mask.stride()
    else:
        mask_strides = (0, 0, 0, 0)
    block_m = 16 if Tq <= 16 else 64
    block_n = 64
    grid = (B * H, triton.cdiv(Tq, block_m))
    _flash_fwd_kernel[grid](
        q, k, v, out, mask if mask is not None else q,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mask_strides,
        H, Tq, Tk, D, LOG2E / math.sqrt(D),
        IS_CAUSAL=is_causal, HAS_MASK=mask is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_head_block(D),
        num_warps=4, num_stages=2 if not interpreting() else 1,
    )
    return out, None


# --------------------------------------------------------------------------------------------------
# Decode: one query per sequence, keys read from its cache slot up to its own length, split-K
# --------------------------------------------------------------------------------------------------
@triton.jit
def _flash_decode_split_kernel(
    Q, KC, VC, Tables, Lengths, PartO, PartM, PartL,
    s_qb, s_qh, s_qd, s_tb, block_len,
    s_ks, s_kh, s_kn, s_kd,
    s_vs, s_vh, s_vn, s_vd,
    H, D, split_len, num_splits, qk_scale, GROUP,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_h = h // GROUP  # grouped-query attention: GROUP query heads read one cached kv head
    length = tl.load(Lengths + b)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b * s_qb + h * s_qh + offs_d * s_qd, mask=d_ok, other=0.0).to(tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, length)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    k_base = KC + kv_h * s_kh
    v_base = VC + kv_h * s_vh
    for start in range(lo, hi, BLOCK_N):  # empty when this split lies past the sequence's length
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        # Each position's block from the row's table (a static cache: one block per row, as long as the cache).
        block = tl.load(Tables + b * s_tb + cols // block_len, mask=col_ok, other=0).to(tl.int64)
        k_rows = block * s_ks + (cols % block_len) * s_kn
        v_rows = block * s_vs + (cols % block_len) * s_vn
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * s_kd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (N, D)
        s = tl.sum(k * q[None, :], 1) * qk_scale
        s = tl.where(col_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.math.exp2(s - m_new)
        alpha = tl.math.exp2(m_i - m_new)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :] * s_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    part = pid_bh * num_splits + split
    tl.store(PartO + part * BLOCK_D + offs_d, acc)
    tl.store(PartM + part, m_i)
    tl.store(PartL + part, l_i)


@triton.jit
def _flash_decode_merge_kernel(
    PartO, PartM, PartL, Out,
    s_ob, s_oh, s_od,
    H, D, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    base = pid_bh * num_splits
    m = tl.load(PartM + base + offs_s, mask=s_ok, other=float("-inf"))
    lsum = tl.load(PartL + base + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok & (lsum > 0), tl.math.exp2(m - m_max), 0.0)
    parts = tl.load(PartO + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(lsum * w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * s_ob + h * s_oh + offs_d * s_od, out.to(Out.dtype.element_ty), mask=offs_d < D)


def decode_splits(max_len: int, block_n: int = 64, target_chunk: int = 256, max_splits: int = 16) -> tuple[int, int]:
    """(num_splits, split_len) for caches of up to `max_len` positions: chunks of about `target_chunk` keys,
    a multiple of the key block. Depends on the static cache bound only, so shapes (and CUDA graphs) do
    not change from step to step."""
    num_splits = max(1, min(max_splits, triton.cdiv(max_len, target_chunk)))
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    return triton.cdiv(max_len, split_len), split_len


def flash_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor, max_len: int | None = None
) -> Tensor:
    """Attention of one query per sequence over its own cached keys.

    q: (B, H, 1, D); k_cache/v_cache: (num_blocks, KV, block_len, D) (any strides) with H a multiple of KV
    (query head j reads kv head j // (H / KV)); tables (B, W): the blocks that hold each row's positions
    0, block_len, 2 * block_len, ... (a static cache: (B, 1), each row's slot, block_len the cache length);
    lengths (B,) number of valid positions of each row (the query attends over [0, length)). `max_len` bounds
    the lengths (default W * block_len); it fixes the split layout. Returns (B, H, 1, D).
    """
    _check_device(q, k_cache, v_cache, tables, lengths)
    B, H, _, D = q.shape
    block_len = k_cache.size(2)
    bound = min(max_len or tables.size(1) * block_len, tables.size(1) * block_len)
    block_n, block_d = 64, _head_block(D)
    num_splits, split_len = decode_splits(bound, block_n)
    part_o = torch.empty(B * H * num_splits, block_d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    qs = q[:, :, 0]
    _flash_decode_split_kernel[(B * H, num_splits)](
        qs, k_cache, v_cache, tables, lengths.to(torch.int32).contiguous(), part_o, part_m, part_l,
        *qs.stride(), tables.stride(0), block_len, *k_cache.stride(), *v_cache.stride(),
        H, D, split_len, num_splits, LOG2E / math.sqrt(D), H // k_cache.size(1),
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4,
    )
    o = out[:, :, 0]
    _flash_decode_merge_kernel[(B * H,)](
        part_o, part_m, part_l, o, *o.stride(), H, D, num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d, num_warps=1,
    )
    return out
