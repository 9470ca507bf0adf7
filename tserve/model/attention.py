"""One multi-head attention module for self- and cross-attention, with pluggable backends.

Backends are chosen by name and all compute softmax(q k^T / sqrt(d_head) + mask) v:

- `math`: the explicit computation; the only one that can return the probabilities.
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` (FlashAttention / memory-efficient kernels on
  CUDA, a fused kernel on CPU).
- `flash`: our own Triton kernels (`model.kernels.flash`); CUDA only, imported lazily when asked for. Its
  decode kernel reads each sequence's keys straight from the KV cache up to that sequence's own length.
- `flash-decode`: `sdpa`, except one-token steps over the paged cache: `flash`'s decode kernel (CUDA).
- `cpu-decode`: our C++ kernels (`model.kernels.cpu`, CPU): one-token steps over the paged cache read each
  row's positions through its block table with no gather; a prompt's attention (prefill, an encoder's unmasked
  pass) runs on `prefill_attention`, grouped kv heads read in place; calls they do not take (a mask, dropout,
  gradients, other dtypes) on `sdpa`.

Asking for weights always works: the call then runs on the `math` path whatever backend serves traffic.

Masks are boolean, True = may attend, broadcastable to (B, n_heads, T_query, T_key). Models build one mask
per forward (see `causal_mask`, `padding_mask`) and hand it to every layer. A float mask is added to the
scores instead: T5's relative position bias, with -inf where a key may not be attended
(`model.relative_positions`). `flash` runs such calls on `sdpa`: its Triton kernels take boolean masks only
(T5's cross-attention, which has no bias, stays on them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tserve.model import rope
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.kv_cache import CachedDecodeKernel, PagedLayerKV, PagedSourceKV, SharedSources
from tserve.model.norms import RMSNorm

# flash-decode: PyTorch SDPA (FlashAttention) for prefill and encoders, our Triton flash-decoding kernel for
# one-token steps straight from the cache (no gather of the rows, no padding mask). What `auto` picks on CUDA:
# on an H100, SDPA's prefill was 1.6x our Triton prefill kernel, and our decode kernel 2.6x SDPA over a padded
# cache (docs/BENCHMARKS.md, GPU).
# cpu-decode: our C++ kernels on the CPU; in process on the opus-mt shape (32 rows, int8) a decode step's
# self-attention took a third of the time of SDPA after a gather of the rows' blocks, and a 2,048-token prompt's
# attention on the SmolLM2-135M shape 0.40 of SDPA's (docs/BENCHMARKS.md).
BACKENDS = ("math", "sdpa", "flash", "flash-decode", "cpu-decode")
TRITON_BACKENDS = ("flash", "flash-decode")


class KVWriter(Protocol):
    """Where a layer's new keys/values go; returns the keys/values the queries should attend over."""

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------
def math_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float = 0.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Explicit attention. q: (B, H, Tq, D), k/v: (B, H, Tk, D). Returns (out, probabilities). `softcap`
    (Gemma 2): scores capped to softcap * tanh(scores / softcap) before the mask."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, Tq, Tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        Tq, Tk = q.size(-2), k.size(-2)
        causal = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        mask = causal if mask is None else mask & causal
    if mask is not None and mask.is_floating_point():
        scores = scores + mask
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Softmax in float32 so that bf16/fp16 rows still sum to one.
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    attended = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
    return attended @ v, probs


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float = 0.0
) -> tuple[Tensor, None]:
    """PyTorch's fused attention; `is_causal` without a mask lets it pick the flash kernel."""
    Tq, Tk = q.size(-2), k.size(-2)
    if is_causal and (mask is not None or Tq != Tk):
        # SDPA's own causal flag aligns the diagonal top-left; ours aligns it bottom-right (queries are
        # the last Tq of Tk positions), so spell the mask out unless the two agree.
        causal = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        mask = causal if mask is None else mask & causal
        is_causal = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    return out, None


def cpu_kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float = 0.0,
    starts: Tensor | None = None,
) -> tuple[Tensor, None]:
    """`cpu-decode`'s attention of whole sequences: our kernel (`kernels.cpu.prefill_attention`, 2.4-3.5x
    PyTorch's CPU flash attention on AVX-512, 1.2-1.9x on AVX2: docs/BENCHMARKS.md) where it serves; `sdpa`
    otherwise. k/v may have fewer heads than q (grouped-query attention: the kernel reads them in place).
    `starts` (B,), causal only: row b's queries are positions starts[b], starts[b] + 1, ... of the keys (prompts
    after cached prefixes of their own lengths) instead of the last Tq of them."""
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    aligned = not is_causal or starts is not None or q.size(-2) <= k.size(-2)
    if mask is None and not dropout_p and not grads and aligned and cpu_kernels.prefill_path(q, k) is not None:
        return cpu_kernels.prefill_attention(q, k, v, is_causal, starts=starts if is_causal else None), None
    if is_causal and starts is not None:
        mask, is_causal = causal_from(starts, q.size(-2), k.size(-2), mask), False
    return _grouped(sdpa_attention, q, k, v, mask, is_causal, dropout_p)


def causal_from(starts: Tensor, Tq: int, Tk: int, mask: Tensor | None = None) -> Tensor:
    """The causal mask (B, 1, Tq, Tk) of queries at positions starts[b] + t over keys 0..Tk-1, with `mask`."""
    causal = causal_mask(starts[:, None] + torch.arange(Tq, device=starts.device), Tk)
    return causal if mask is None else mask & causal


cpu_kernel_attention.takes_groups = True  # `_grouped` hands it k/v as they are


AttentionFn = Callable[..., tuple[Tensor, Tensor | None]]
CachedDecodeFn = CachedDecodeKernel

def _flash_module():  # noqa: ANN202
    try:
        from tserve.model.kernels import flash  # noqa: PLC0415 (optional, CUDA-only)
    except ImportError as exc:
        raise ValueError(
            "attention backend 'flash' needs CUDA and Triton (our Triton kernels); "
            "use 'sdpa' or 'math' on this machine"
        ) from exc
    return flash


def get_backend(name: str) -> AttentionFn:
    """Resolve a backend name to its function; `flash` is imported only when asked for."""
    if name == "math":
        return math_attention
    if name == "cpu-decode":
        return cpu_kernel_attention
    if name in ("sdpa", "auto", "flash-decode"):
        return sdpa_attention
    if name == "flash":
        return _flash_module().flash_attention
    raise ValueError(f"unknown attention backend {name!r}; expected one of {('auto', *BACKENDS)}")


def get_cached_decode(name: str) -> CachedDecodeFn | None:
    """A backend's kernel for one-token decode straight from the KV cache, if it has one."""
    if name == "cpu-decode":
        return cpu_kernels.paged_decode
    return _flash_module().flash_decode if name in TRITON_BACKENDS else None


def resolve_backend(name: str, device: torch.device | str = "cpu") -> str:
    """Turn `auto` into a concrete backend and check the choice is usable on `device`. `auto`: `flash-decode` on
    CUDA where Triton is installed, `cpu-decode` on the CPU where its kernel builds, else `sdpa`."""
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if not on_cuda:
            return "cpu-decode" if torch.device(device).type == "cpu" and cpu_kernels.available() else "sdpa"
        try:
            _flash_module()
        except ValueError:
            return "sdpa"
        return "flash-decode"
    if name in TRITON_BACKENDS and not on_cuda:
        raise ValueError(f"attention backend {name!r} runs on CUDA only; use 'sdpa' or 'math' on CPU")
    if name == "cpu-decode" and (torch.device(device).type != "cpu" or not cpu_kernels.available()):
        raise ValueError("attention backend 'cpu-decode' runs on the CPU and needs its C++ kernel built (a C++ "
                         "compiler; see the log); use 'sdpa'")
    get_backend(name)
    get_cached_decode(name)  # the Triton kernels import, or a clear error
    return name


# --------------------------------------------------------------------------------------------------
# Masks and rotary embeddings
# --------------------------------------------------------------------------------------------------
def padding_mask(lengths: Tensor, max_len: int) -> Tensor:
    """(B, 1, 1, max_len) True where the key index is < the sequence's length."""
    return (torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def causal_mask(query_positions: Tensor, key_len: int, window: int | None = None) -> Tensor:
    """(B, 1, Tq, key_len) True where key position <= query position (keys are cache positions 0..L-1), and
    with a `window`, query position - key position < window (the query's last `window` positions). A padding
    query past the keys (a short row's padding in a batch whose longest row reaches further) sees the last
    `window` keys: never none, whose softmax would be NaN and reach the cache through its keys and values."""
    keys = torch.arange(key_len, device=query_positions.device)[None, None, :]
    allowed = keys <= query_positions[:, :, None]
    if window is not None:
        allowed &= keys > query_positions[:, :, None].clamp(max=key_len - 1) - window
    return allowed[:, None]


@dataclass
class Rotary:
    """cos/sin tables gathered at the positions of one forward; applied to q and k (GPT-NeoX layout). Tables
    narrower than the head rotate its first channels only (partial rotary: Phi-4-mini), the rest pass."""

    cos: Tensor  # (B, 1, T, R/2), R the rotated channels (the head size, or fewer)
    sin: Tensor

    @staticmethod
    def tables(d_head: int, max_len: int, base: float = 10000.0,
               scaling: dict | None = None) -> tuple[Tensor, Tensor]:
        return rope.tables(d_head, max_len, base, scaling)

    @classmethod
    def at(cls, cos: Tensor, sin: Tensor, positions: Tensor, dtype: torch.dtype) -> Rotary:
        return cls(cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype))

    def apply(self, x: Tensor) -> Tensor:
        rotated = 2 * self.cos.size(-1)
        if rotated < x.size(-1):
            return torch.cat((self.apply(x[..., :rotated]), x[..., rotated:]), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos), dim=-1)


# --------------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head attention. Self-attention uses one fused QKV projection; cross-attention projects
    queries from `x` and keys/values from the encoder output (or takes them precomputed from a cache).

    Args:
        d_model: model width; n_heads: number of query heads.
        n_kv_heads: key/value heads (grouped-query attention: query head j reads kv head j // (H / KV));
            default n_heads. d_head: head size, default d_model // n_heads.
        cross: cross-attention (separate `q` and fused `kv` projections) instead of self-attention.
        bias: biases on the q/k/v projections; out_bias: on the output projection (default `bias`).
        qk_norm_eps: RMSNorm each head's queries and keys (Qwen3) with this epsilon; None: no norm.
        norm_offset: those norms scale by (norm_offset + weight) (Gemma).
        rotates: apply the rotary positions it is given (False: a layer without positions, SmolLM3's NoPE).
        scale: scores scaled by this instead of 1 / sqrt(d_head) (applied to the queries, for every backend).
        softcap: scores soft-capped (Gemma 2); such a layer attends on the `math` path.
        window: a sliding-window layer's window (the mask it is given says so; the decode kernel is told).
        dropout: dropout on the attention probabilities (training only).
        backend: `auto | math | sdpa | flash`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        cross: bool = False,
        bias: bool = True,
        out_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        norm_offset: float = 0.0,
        rotates: bool = True,
        scale: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.rotates = rotates
        self.softcap = softcap
        self.window = window
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.d_head = d_head or d_model // n_heads
        # The backends all scale by 1 / sqrt(d_head): another scale is folded into the queries.
        self.query_scale = None if scale is None else scale * math.sqrt(self.d_head)
        self.cross = cross
        self.dropout = dropout
        q_width, kv_width = n_heads * self.d_head, self.n_kv_heads * self.d_head
        self.widths = (q_width, kv_width, kv_width)
        if cross:
            self.q = nn.Linear(d_model, q_width, bias=bias)
            self.kv = nn.Linear(d_model, 2 * kv_width, bias=bias)
        else:
            self.qkv = nn.Linear(d_model, q_width + 2 * kv_width, bias=bias)
        self.proj = nn.Linear(q_width, d_model, bias=bias if out_bias is None else out_bias)
        self.q_norm = RMSNorm(self.d_head, qk_norm_eps, norm_offset) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(self.d_head, qk_norm_eps, norm_offset) if qk_norm_eps is not None else None
        self.set_backend(backend)

    def set_backend(self, name: str) -> None:
        self.backend = name
        self._attend = get_backend(name)
        self._cached_decode = get_cached_decode(name)
        if self.softcap is not None:  # no fused kernel caps the scores
            self._attend = functools.partial(math_attention, softcap=self.softcap)
            self._cached_decode = None
        elif self.window is not None and name != "cpu-decode":
            self._cached_decode = None  # only the CPU kernel reads a window

    def _heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, -1, self.d_head).transpose(1, 2)  # (B, H, T, D)

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys/values of an encoder output (B, S, C) -> two (B, H, S, D)."""
        k, v = self.kv(context).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        rotary: Rotary | None = None,
        cache: KVWriter | None = None,
        context: Tensor | None = None,
        context_kv: tuple[Tensor, Tensor] | PagedSourceKV | None = None,
        shared_sources: SharedSources | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, C). Returns (output (B, T, C), probabilities (B, H, T, Tk) or None).

        Self-attention: new keys/values are written to `cache` (if given), which returns what to attend
        over. Cross-attention: keys/values come from `context_kv` (cached) or are projected from `context`;
        with `shared_sources`, `context_kv` and `mask` hold one entry per distinct source, not per row.
        """
        if self.cross and shared_sources is not None and not need_weights:
            return self._attend_shared(x, context_kv, mask, shared_sources), None
        if isinstance(context_kv, PagedSourceKV):  # one token per row, its source read in place by the kernel
            out = context_kv.decode(self._cached_decode, self._heads(self.q(x)))
            return self.proj(out.transpose(1, 2).reshape(x.size(0), 1, -1)), None
        if self.cross:
            q = self._heads(self.q(x))
            k, v = context_kv if context_kv is not None else self.project_kv(context)
        else:
            q, k, v = (self._heads(t) for t in self.qkv(x).split(self.widths, dim=-1))
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if rotary is not None and self.rotates:
                q, k = rotary.apply(q), rotary.apply(k)
            if self.query_scale is not None:
                q = q * self.query_scale
            if cache is not None:
                if self._cached_decode is not None and not need_weights and _direct_decode(q, cache, mask):
                    # One token per sequence: attend over [0, position] of its own slot, no gather.
                    cache.store(k, v)
                    out = cache.decode(self._cached_decode, q, self.window)
                    return self.proj(out.transpose(1, 2).reshape(q.size(0), 1, -1)), None
                k, v = cache.update(k, v)
        attend = self._attend
        if is_causal and isinstance(cache, PagedLayerKV) and cache.kv_len is not None:
            # Prompts after cached prefixes (the decoder's prefill, `cpu-decode`): each row's queries start at its
            # own first new position. The kernel takes those; any other path is handed them as a mask.
            starts = cache.view.positions[:, 0]
            if attend is cpu_kernel_attention and not need_weights:
                attend = functools.partial(cpu_kernel_attention, starts=starts)
                attend.takes_groups = True
            else:
                mask, is_causal = causal_from(starts, q.size(2), k.size(2), mask), False
        if need_weights:
            attend = math_attention if self.softcap is None else functools.partial(math_attention, softcap=self.softcap)
        if not need_weights and self.backend == "flash" and mask is not None and mask.is_floating_point():
            attend = sdpa_attention  # a position bias: the Triton kernels take boolean masks only
        dropout_p = self.dropout if self.training else 0.0
        out, probs = _grouped(attend, q, k, v, mask, is_causal, dropout_p)
        B, _, T, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(B, T, -1)), probs

    def _attend_shared(self, x: Tensor, context_kv: tuple[Tensor, Tensor], mask: Tensor | None,
                       shared: SharedSources) -> Tensor:
        """One token per row (x: (B, 1, C)); the rows of each source attend as one query block."""
        B, _, C = x.shape
        q = self.q(x).view(B, self.n_heads, self.d_head)
        q = torch.cat([q, q.new_zeros(1, self.n_heads, self.d_head)])[shared.query_rows]  # (U, G, H, D)
        k, v = context_kv
        out, _ = self._attend(q.transpose(1, 2), k, v, mask, False, 0.0)  # (U, H, G, D)
        out = out.transpose(1, 2).reshape(-1, C)[shared.row_positions]
        return self.proj(out.view(B, 1, C))


def _grouped(attend: AttentionFn, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
             dropout_p: float) -> tuple[Tensor, Tensor | None]:
    """Attention with fewer key/value heads than query heads (k/v: (B, KV, Tk, D)). One query per sequence:
    each kv head's G query heads attend as a block of G queries over its keys, with no copy. Otherwise every
    kv head is repeated for its G query heads, so the weights (`math`) come out per query head."""
    group = q.size(1) // k.size(1)
    if group == 1 or getattr(attend, "takes_groups", False):
        return attend(q, k, v, mask, is_causal, dropout_p)
    B, H, Tq, D = q.shape
    weighs = attend is math_attention or getattr(attend, "func", None) is math_attention
    if Tq == 1 and not weighs:  # one query: causal allows every key
        out, _ = attend(q.view(B, k.size(1), group, D), k, v, mask, False, dropout_p)
        return out.reshape(B, H, 1, D), None  # SDPA on CUDA may hand back another memory layout
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return attend(q, k, v, mask, is_causal, dropout_p)


def _direct_decode(q: Tensor, cache: KVWriter, mask: Tensor | None) -> bool:
    """Whether the flash decode kernel can serve this call: one query per sequence and no position bias."""
    biased = mask is not None and mask.is_floating_point()
    return isinstance(cache, PagedLayerKV) and q.size(2) == 1 and cache.kv_len is not None and not biased
