"""A causal language model's one-token decode step through all its layers in one C++ call, on the CPU
(`tserve/model/kernels/decode_layers.cpp`; `--fused-layers`).

A decode step of a small model on a CPU is mostly dispatch: each layer was ~180 PyTorch operators (norms, splits,
the rotation, cache writes, views, the activation, residual adds) around its four products, each operator a few
µs, more than the arithmetic on one row. `FusedDecode` hands the layers' weights to the kernel once, and a step
is then one call that runs every layer's products on their own kernels (Q8_0 / Q4_0 panels; float32 weights as
`nn.Linear` holds them, read row by row by `dense_rows`, or oneDNN's pre-packed ones) with loops over the rows'
vectors in between, and ends with the final norm and the output layer.

It serves what `Block` computes for the layouts it knows (`FusedDecode.build` says which; anything else keeps the
modules): pre-norm blocks with LayerNorm or RMSNorm (Gemma's offset), GPT-2's and Llama's MLPs (gated ones
fused as `MLP.gate_fc1`), q/k norms, rotary positions (partial, local tables for sliding layers, layers
without), sliding windows, sandwich norms, residual multipliers and attention scales, on float32 weights and the
cache in float32, with the `cpu-decode` attention backend. Equal to the modules within float32 rounding (a
norm's sum adds in another order); greedy tokens equal on the tests' models.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from tserve.model.block_quant import BlockLinear
from tserve.model.kernels import cpu as cpu_kernels
from tserve.model.packed_linear import OneDNNLinear, PackedLinear

log = logging.getLogger("tserve.fused")

_ACTIVATIONS = {"swiglu": 0, "gated_gelu_tanh": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4, "silu": 5}
_DENSE, _PACKED, _Q8, _Q4 = 0, 1, 2, 3
_NONE = torch.empty(0)


def _product(layer: nn.Module) -> tuple[int, int, Tensor, Tensor, Tensor] | None:
    """(kind, outputs, weight or panels, scales, bias) of a linear layer the kernel runs, else None."""
    if type(layer) in (nn.Linear, OneDNNLinear) and layer.weight.dtype == torch.float32:
        return _DENSE, layer.out_features, layer.weight.detach(), _NONE, _bias(layer.bias)
    if isinstance(layer, PackedLinear):
        return _PACKED, layer.out_features, layer.packed_weight, _NONE, _bias(layer.bias)
    if isinstance(layer, BlockLinear) and layer.isa is not None:
        return _Q8 if layer.fmt == "q8_0" else _Q4, layer.out_features, layer.codes, layer.scales, _bias(layer.bias)
    return None


def _bias(bias: Tensor | None) -> Tensor:
    return _NONE if bias is None else bias.detach()


def _norm(norm: nn.Module) -> tuple[Tensor, Tensor]:
    return norm.weight.detach(), _bias(getattr(norm, "bias", None))


class FusedDecode:
    """A model's fused step: the kernel's `DecodePlan`, which holds what does not change between steps (every
    layer's tensors and integers, the config, the embeddings and position tables, the block kernels' instruction
    set) so that a step passes only the rows' tokens, positions and cache."""

    def __init__(self, tensors: list[Tensor], ints: list[int], config: list[float], isa: str, inputs: list) -> None:
        self.plan = cpu_kernels.extension().decode_plan(tensors, ints, config, isa, *inputs)

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecode | None:
        """The fused step of `model` (a `model.decoder.Decoder`), or None with the reason logged at debug level:
        the kernels are not built, or a layer's layout is one the kernel does not compute."""
        reason = _unfusable(model)
        if reason is not None:
            log.debug("decode steps run layer by layer", extra={"why": reason})
            return None
        cfg = model.cfg
        tensors: list[Tensor] = []
        ints: list[int] = []
        isas = {m.isa for m in model.modules() if isinstance(m, BlockLinear)}
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            products = [_product(attn.qkv), _product(attn.proj), _product(mlp.gate_fc1 or mlp.fc1), _product(mlp.fc2)]
            if any(p is None for p in products):
                return None
            norm1, norm2 = _norm(block.norm1), _norm(block.norm2)
            q_norm = attn.q_norm.weight.detach() if attn.q_norm is not None else _NONE
            k_norm = attn.k_norm.weight.detach() if attn.k_norm is not None else _NONE
            qkv, o, up, down = products
            tensors += [*norm1, *qkv[2:], q_norm, k_norm, *o[2:], *norm2, *up[2:], *down[2:],
                        block.norm1_out.weight.detach() if block.norm1_out is not None else _NONE,
                        block.norm2_out.weight.detach() if block.norm2_out is not None else _NONE]
            rotates = cfg.positions == "rope" and attn.rotates
            ints += [qkv[0], qkv[1], o[0], o[1], up[0], up[1], down[0], down[1], int(rotates),
                     attn.window or 0]
        # The final norm (made as the layers' norms are) after the last layer, where the model has one, then the
        # output layer.
        output = _product(model.lm_head)
        if output is None:
            return None
        tensors += [*(_norm(model.norm_f) if model.cfg.final_norm else (_NONE, _NONE)), *output[2:]]
        ints += [output[0], output[1]]
        first = model.blocks[0].attn
        qk_eps = first.q_norm.eps if first.q_norm is not None else 0.0
        rotary = (cfg.rotary_dim or cfg.d_head) if cfg.positions == "rope" else 0
        # config[3], the cache's block size, is each step's.
        config = [cfg.n_heads, cfg.kv_heads, cfg.d_head, 0, rotary, _ACTIVATIONS[cfg.activation],
                  float(cfg.norm == "layernorm"), float(cfg.qk_norm), float(cfg.local_rope_base is not None),
                  cfg.norm_eps, cfg.norm_weight_offset, qk_eps, first.query_scale or 0.0, cfg.residual_multiplier]
        return cls(tensors, ints, config, next(iter(isas), None) or cpu_kernels.kernel_isa(), _step_inputs(model))

    def step(self, tokens: Tensor | list[int], positions: Tensor | list[int], cache,  # noqa: ANN001 - PagedKVCache
             slots: Tensor | list[int]) -> Tensor:
        """One new token per row: tokens (B,) at positions (B,) in cache rows `slots` (B,), as host lists of ints (or
        CPU tensors) -> the output layer's logits (B, vocabulary), before the family's scaling and soft cap
        (`Decoder.scale_logits`). The embeddings, each row's cache writes and reads (`PagedKVCache.view`'s plan) and
        its rotary rows are made in the call, with no tensor operator but the logits' allocation."""
        local = cache.local  # the sliding layers' own cache, where they keep one
        own = (local.k, local.v, local.tables) if local is not None else (_NONE,) * 3
        return self.plan.step(_ints(tokens), _ints(positions), _ints(slots), cache.block_size, cache.k, cache.v,
                              cache.tables, *own)


def _ints(values: Tensor | list[int]) -> list[int]:
    return values.tolist() if isinstance(values, Tensor) else values


def _step_inputs(model: nn.Module) -> list:
    """What a step's embeddings and rotary rows are made of: the token embeddings (float32) and their scale, the
    position table added to them (learned or sinusoidal; or none), the rotary cos / sin tables (or none) and the
    sliding layers' own (or none)."""
    cfg = model.cfg
    table = {"learned": lambda: model.pos_emb.weight, "sinusoidal": lambda: model.pos_table}.get(cfg.positions)
    rope = cfg.positions == "rope"
    local = rope and cfg.local_rope_base is not None
    return [model.tok_emb.weight.detach(), float(model.embed_scale), table().detach().float() if table else _NONE,
            *((model.rope_cos.float(), model.rope_sin.float()) if rope else (_NONE, _NONE)),
            *((model.local_rope_cos.float(), model.local_rope_sin.float()) if local else (_NONE, _NONE))]


def _unfusable(model: nn.Module) -> str | None:
    """Why `model`'s decode step cannot run fused, or None when it can."""
    cfg = model.cfg
    if not cpu_kernels.available():
        return "the CPU kernels are not built"
    if cpu_kernels.kernel_isa() is None:  # not compiled for this CPU, or PyTorch held below AVX2: no vector path
        return "the CPU kernels do not run here"
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return f"{first.dtype} on {first.device} (float32 on the CPU only)"
    if cfg.norm_placement != "pre" or cfg.n_experts or cfg.attention_softcap is not None:
        return "post-norm blocks, experts or soft-capped attention"
    if cfg.sandwich_norms and cfg.norm != "rmsnorm":
        return "sandwich LayerNorms"
    if cfg.positions not in ("rope", "learned", "sinusoidal") or cfg.activation not in _ACTIVATIONS:
        return f"positions {cfg.positions}, activation {cfg.activation}"
    for block in model.blocks:
        if block.attn.backend != "cpu-decode" or block.cross_attn is not None:
            return f"attention backend {block.attn.backend}"
        if block.mlp.gated and block.mlp.gate_fc1 is None:
            return "gate and fc1 not fused (`MLP.fuse_gate`)"
    return None
