"""Model configurations: plain dataclasses that round-trip through JSON.

One config per architecture. Every option that changes the maths of a layer lives here, so that a
checkpoint's `config.json` fully describes the network and importers only have to fill fields in.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

Norm = Literal["layernorm", "rmsnorm"]
NormPlacement = Literal["pre", "post"]
# `gelu_tanh` is GPT-2's "gelu_new"; `silu` is Marian's "swish"; `swiglu` is a gated MLP (Llama's) and
# `gated_gelu_tanh` the same with GPT-2's GELU (T5 v1.1's "gated-gelu").
Activation = Literal["gelu", "gelu_tanh", "relu", "silu", "swiglu", "gated_gelu_tanh"]
# `relative`: no position added to the inputs; T5's learned relative position bias on the attention scores.
Positions = Literal["learned", "sinusoidal", "rope", "relative"]

_NORMS = ("layernorm", "rmsnorm")
_PLACEMENTS = ("pre", "post")
_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "gated_gelu_tanh")
_POSITIONS = ("learned", "sinusoidal", "rope", "relative")


@dataclass
class BlockConfig:
    """Options shared by every transformer stack (decoder, encoder-decoder, ViT)."""

    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    norm: Norm = "layernorm"
    norm_placement: NormPlacement = "pre"
    norm_eps: float = 1e-5
    activation: Activation = "gelu"
    bias: bool = True
    dropout: float = 0.0
    # Grouped-query attention: keys/values have `n_kv_heads` heads, each shared by n_heads / n_kv_heads query
    # heads (None: as many as the queries). `head_dim` None: d_model // n_heads.
    n_kv_heads: int | None = None
    head_dim: int | None = None
    # Biases per projection where a family differs from `bias` (None: `bias`). Qwen2: q/k/v only.
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys, before the rotation
    # Gemma: every RMSNorm scales by (norm_weight_offset + weight), its weights stored as offsets from one.
    norm_weight_offset: float = 0.0
    # Gemma 2/3: each sub-layer's output is normed again before the residual add (a norm on either side of it).
    sandwich_norms: bool = False
    residual_multiplier: float = 1.0  # Granite: each sub-layer's output times this before the residual add
    # Attention scores scaled by this instead of 1 / sqrt(head size): Gemma's query_pre_attn_scalar ** -0.5,
    # Granite's attention_multiplier.
    attention_scale: float | None = None
    # Gemma 2: attention scores soft-capped to cap * tanh(scores / cap) before the mask.
    attention_softcap: float | None = None
    # Sliding-window attention: a query of the layers in `sliding_layers` sees its last `sliding_window`
    # positions, its own included (Mistral, Phi-3: every layer; Gemma 2/3: interleaved with global layers).
    sliding_window: int | None = None
    sliding_layers: list[int] = field(default_factory=list)
    # Partial rotary (Phi-4-mini): the first `rotary_dim` channels of each head rotate, the rest pass unrotated.
    rotary_dim: int | None = None
    # Layers whose attention takes no positions (rope positions elsewhere; SmolLM3 leaves every fourth out).
    nope_layers: list[int] = field(default_factory=list)
    # Mixture of experts: 0 = dense MLP; otherwise each token is routed to `moe_top_k` of `n_experts` MLPs.
    n_experts: int = 0
    moe_top_k: int = 2

    architecture: ClassVar[str] = ""

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def __post_init__(self) -> None:
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        _check_choice("norm", self.norm, _NORMS)
        _check_choice("norm_placement", self.norm_placement, _PLACEMENTS)
        _check_choice("activation", self.activation, _ACTIVATIONS)
        if self.n_experts and not 1 <= self.moe_top_k <= self.n_experts:
            raise ValueError(f"moe_top_k must be in [1, n_experts={self.n_experts}], got {self.moe_top_k}")
        if self.sliding_layers and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding_layers need a positive sliding_window")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.d_head):
            raise ValueError(f"rotary_dim {self.rotary_dim}: an even number of channels, at most the head size")
        positions = getattr(self, "positions", None)
        if positions is not None:
            _check_choice("positions", positions, _POSITIONS)
            if positions == "rope" and self.d_head % 2:
                raise ValueError("rope positions need an even head size")

    # --- JSON round trip -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockConfig:
        data = dict(data)
        arch = data.pop("architecture", cls.architecture)
        target = CONFIG_CLASSES.get(arch) if cls is BlockConfig else cls
        if target is None:
            raise ValueError(f"unknown architecture {arch!r}; expected one of {sorted(CONFIG_CLASSES)}")
        if target.architecture != arch:
            raise ValueError(f"config says architecture {arch!r}, expected {target.architecture!r}")
        names = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown {arch} config fields: {unknown}")
        return target(**data)

    @classmethod
    def from_json(cls, text: str) -> BlockConfig:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


@dataclass
class DecoderConfig(BlockConfig):
    """GPT-style causal language model."""

    vocab_size: int = 8192
    n_layers: int = 4
    max_seq_len: int = 512
    positions: Positions = "learned"
    rope_base: float = 10000.0
    # {"rope_type": "llama3" | "linear" | "dynamic", "factor": ..., ...}: model.rope says what each reads.
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    embedding_multiplier: float = 1.0  # Granite: token embeddings multiplied by this
    # Gemma 3: the sliding layers rotate with a rope base (and scaling) of their own.
    local_rope_base: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    final_norm: bool = True
    # The output layer's logits: divided by `logits_divisor` (Granite's logits_scaling), then soft-capped to
    # cap * tanh(logits / cap) (Gemma 2).
    logits_divisor: float = 1.0
    logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    architecture: ClassVar[str] = "decoder"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nope_layers and (self.positions != "rope" or not all(0 <= i < self.n_layers for i in self.nope_layers)):
            raise ValueError(f"nope_layers {self.nope_layers}: layers (of {self.n_layers}) left out of rope positions")
        if not all(0 <= i < self.n_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers}: layers of {self.n_layers}")
        if self.local_rope_base is None and self.local_rope_scaling is not None:
            raise ValueError("local_rope_scaling scales the local rope base: set local_rope_base too")
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            if scaling is not None:
                from tserve.model.rope import check_scaling  # noqa: PLC0415 (rope imports torch; configs stay light)

                check_scaling(scaling)


@dataclass
class Seq2SeqConfig(BlockConfig):
    """Vaswani encoder-decoder (Marian / opus-mt layout) with a shared source/target vocabulary."""

    vocab_size: int = 8192
    n_encoder_layers: int = 4
    n_decoder_layers: int = 4
    max_source_len: int = 256
    max_target_len: int = 256
    positions: Positions = "sinusoidal"
    rope_base: float = 10000.0
    # Sinusoidal tables: Marian's frequencies or fairseq's (M2M100 / NLLB), and the row of position 0
    # (fairseq starts at padding index + 1).
    sinusoid: Literal["marian", "fairseq"] = "marian"
    position_offset: int = 0
    # Relative positions (T5): buckets of the learned bias and the distance past which all share one.
    relative_buckets: int = 32
    relative_max_distance: int = 128
    tie_embeddings: bool = True  # encoder, decoder and output projection share one matrix
    scale_embeddings: bool = True
    final_norm: bool = False  # a last norm on each stack's output (pre-norm models want it)
    final_logits_bias: bool = False
    output_scale: float = 1.0  # the decoder's output is multiplied by this before the output layer (tied T5)
    decoder_start_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 0

    architecture: ClassVar[str] = "seq2seq"


@dataclass
class ViTConfig(BlockConfig):
    """Vision Transformer classifier: patch embedding, class token, learned positions, linear head. DeiT adds
    a distillation token after the class token (`distillation_token`) and, trained with a teacher, a head of its
    own whose logits are averaged with the class token's (`distillation_head`)."""

    image_size: int = 28
    patch_size: int = 4
    n_channels: int = 1
    n_layers: int = 4
    n_classes: int = 10
    norm_eps: float = 1e-6
    activation: Activation = "gelu"
    distillation_token: bool = False
    distillation_head: bool = False

    architecture: ClassVar[str] = "vit"

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid_size**2

    @property
    def n_prefix_tokens(self) -> int:
        """The tokens before the patches: the class token, and DeiT's distillation token."""
        return 2 if self.distillation_token else 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distillation_head and not self.distillation_token:
            raise ValueError("distillation_head reads the distillation token: set distillation_token too")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")


CONFIG_CLASSES: dict[str, type[BlockConfig]] = {
    c.architecture: c for c in (DecoderConfig, Seq2SeqConfig, ViTConfig)
}


def load_config(path: str | Path) -> BlockConfig:
    """Read any of our configs from a `config.json`."""
    return BlockConfig.from_json(Path(path).read_text())


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


__all__ = [
    "BlockConfig",
    "DecoderConfig",
    "Seq2SeqConfig",
    "ViTConfig",
    "CONFIG_CLASSES",
    "load_config",
]
