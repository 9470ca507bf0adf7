"""Building blocks shared by the three architectures: norms, MLPs (dense and mixture-of-experts),
sinusoidal positions and the transformer block."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tserve.model.attention import Attention, KVWriter, Rotary
from tserve.model.config import BlockConfig
from tserve.model.kv_cache import PagedSourceKV, SharedSources
from tserve.model.norms import RMSNorm


def make_norm(cfg: BlockConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_weight_offset)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


_GATED = {"swiglu": F.silu, "gated_gelu_tanh": _ACTIVATIONS["gelu_tanh"]}


class MLP(nn.Module):
    """fc1 -> activation -> fc2; the gated kinds (`swiglu`, `gated_gelu_tanh`) multiply fc1's output by the
    activation of a second projection (LLaMA, T5 v1.1)."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gated = cfg.activation in _GATED
        self.act = _GATED[cfg.activation] if self.gated else _ACTIVATIONS[cfg.activation]
        bias = cfg.bias if cfg.mlp_bias is None else cfg.mlp_bias
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias)
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias) if self.gated else None
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.gate_fc1: nn.Linear | None = None  # gate and fc1 as one product, once `fuse_gate` ran

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_fc1 is not None:
            gate, up = self.gate_fc1(x).chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(self.gate(x)) * self.fc1(x) if self.gated else self.act(self.fc1(x))
        return self.dropout(self.fc2(h))

    @torch.no_grad()
    def fuse_gate(self) -> None:
        """Gate and fc1 as one linear layer of twice the outputs (inference): one call, one read of the input,
        one quantization of it where the weights are int8 or int4. Each output is the same dot product."""
        if self.gate is None:
            return
        w = self.gate.weight
        fused = nn.Linear(w.size(1), 2 * w.size(0), bias=self.gate.bias is not None, device=w.device, dtype=w.dtype)
        fused.weight.copy_(torch.cat([self.gate.weight, self.fc1.weight]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([self.gate.bias, self.fc1.bias]))
        self.gate_fc1, self.gate, self.fc1 = fused, None, None


def fuse_gated_mlps(model: nn.Module) -> None:
    """`MLP.fuse_gate` on every gated MLP of `model` (for inference: the parameters' names change)."""
    for module in model.modules():
        if isinstance(module, MLP):
            module.fuse_gate()


class MoE(nn.Module):
    """Top-k routed mixture of MLP experts. Each token's output is the softmax-weighted sum (over its
    top-k router logits) of the chosen experts' outputs; tokens are grouped per expert so that each
    expert runs once per forward."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        weights, chosen = self.router(x).topk(self.top_k, dim=-1)  # (N, k)
        weights = torch.softmax(weights.float(), dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token_idx, slot = (chosen == e).nonzero(as_tuple=True)
            if token_idx.numel():
                out.index_add_(0, token_idx, expert(x[token_idx]) * weights[token_idx, slot, None])
        return out.view(shape)


def sinusoidal_table(max_len: int, dim: int, style: str = "marian") -> Tensor:
    """(max_len, dim): sin of every frequency in the first half, cos in the second (Marian's layout;
    the same information as Vaswani's interleaved table). `fairseq` (M2M100 / NLLB): frequencies
    10000^(-i / (dim/2 - 1)) instead of 10000^(-2i / dim), computed in float32 as fairseq does."""
    if style == "fairseq":
        half = dim // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
        angles = torch.arange(max_len, dtype=torch.int64).float()[:, None] * freqs[None, :]
        table = torch.cat((angles.sin(), angles.cos()), dim=-1)
        return torch.cat((table, torch.zeros(max_len, dim - table.size(1))), dim=-1)
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat((angles.sin(), angles.cos()), dim=-1)[:, :dim].float()


class Block(nn.Module):
    """Self-attention, optional cross-attention, MLP; each sub-layer residual, norm pre or post (or, with
    `sandwich_norms`, both: Gemma's second norm on the sub-layer's output, before the residual add)."""

    def __init__(self, cfg: BlockConfig, *, cross: bool = False, backend: str = "auto", layer: int = 0) -> None:
        """`layer`: the block's index in its stack (whether its attention takes positions, `cfg.nope_layers`, and
        slides, `cfg.sliding_layers`)."""
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        attn_args = dict(bias=cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias, out_bias=cfg.out_bias,
                         d_head=cfg.d_head, dropout=cfg.dropout, backend=backend)
        self.attn = Attention(cfg.d_model, cfg.n_heads, n_kv_heads=cfg.kv_heads,
                              qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None, norm_offset=cfg.norm_weight_offset,
                              rotates=layer not in cfg.nope_layers, scale=cfg.attention_scale,
                              softcap=cfg.attention_softcap,
                              window=cfg.sliding_window if layer in cfg.sliding_layers else None, **attn_args)
        self.norm1 = make_norm(cfg)
        self.cross_attn = Attention(cfg.d_model, cfg.n_heads, cross=True, **attn_args) if cross else None
        self.norm_cross = make_norm(cfg) if cross else None
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)
        self.norm2 = make_norm(cfg)
        self.norm1_out = make_norm(cfg) if cfg.sandwich_norms else None
        self.norm2_out = make_norm(cfg) if cfg.sandwich_norms else None
        self.residual_multiplier = cfg.residual_multiplier
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: Tensor, norm: nn.Module, fn, out_norm: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        out, probs = fn(norm(x) if self.pre_norm else x)
        if out_norm is not None:
            out = out_norm(out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        x = x + self.dropout(out)
        return (x if self.pre_norm else norm(x)), probs

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
        context_mask: Tensor | None = None,
        shared_sources: SharedSources | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Returns (x, self-attention probabilities, cross-attention probabilities); the probabilities
        are None unless `need_weights`."""
        x, self_probs = self._sublayer(
            x,
            self.norm1,
            lambda h: self.attn(
                h, mask=mask, is_causal=is_causal, rotary=rotary, cache=cache, need_weights=need_weights
            ),
            self.norm1_out,
        )
        cross_probs = None
        if self.cross_attn is not None:
            x, cross_probs = self._sublayer(
                x,
                self.norm_cross,
                lambda h: self.cross_attn(
                    h, mask=context_mask, context=context, context_kv=context_kv,
                    shared_sources=shared_sources, need_weights=need_weights,
                ),
            )
        x, _ = self._sublayer(x, self.norm2, lambda h: (self.mlp(h), None), self.norm2_out)
        return x, self_probs, cross_probs


def set_attention_backend(module: nn.Module, name: str) -> None:
    """Switch every attention layer of a model to backend `name`."""
    for m in module.modules():
        if isinstance(m, Attention):
            m.set_backend(name)
