"""GPT-style causal language model (nanoGPT-like), with cached inference.

Training: `forward(tokens)` -> logits for every position.
Inference: `prefill(tokens, lengths, cache, slots)` runs right-padded prompts and fills their cache rows;
`decode_step(tokens, positions, cache, slots)` advances each running sequence by one token. Both return
the logits of the next token only. The cache is paged (`model.kv_cache.PagedKVCache`): a row's positions
live in the blocks its table names.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tserve.model.attention import Rotary, causal_mask
from tserve.model.config import DecoderConfig
from tserve.model.device_inputs import to_device
from tserve.model.fused_decode import FusedDecode
from tserve.model.kv_cache import PagedKVCache
from tserve.model.layers import Block, make_norm, sinusoidal_table


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        elif cfg.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.d_model), persistent=False)
        else:
            rotated = cfg.rotary_dim or cfg.d_head
            cos, sin = Rotary.tables(rotated, cfg.max_seq_len, cfg.rope_base, cfg.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            if cfg.local_rope_base is not None:  # the sliding layers' own tables (Gemma 3)
                cos, sin = Rotary.tables(rotated, cfg.max_seq_len, cfg.local_rope_base, cfg.local_rope_scaling)
                self.register_buffer("local_rope_cos", cos, persistent=False)
                self.register_buffer("local_rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, backend=backend, layer=i) for i in range(cfg.n_layers))
        self.norm_f = make_norm(cfg) if cfg.final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(_init_weights)
        self.embed_scale = (math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0) * cfg.embedding_multiplier
        self.sliding_layers = frozenset(cfg.sliding_layers)
        self.fused: FusedDecode | None = None  # one-token steps in one C++ call (`fuse_decode`)

    def fuse_decode(self) -> bool:
        """Run one-token decode steps through every layer in one C++ call from now on, where the layers' layout
        allows (`model.fused_decode`); inference only, after the weights are in their final form (quantized,
        packed). Returns whether it does."""
        self.fused = FusedDecode.build(self)
        return self.fused is not None

    # ----------------------------------------------------------------------------------------------
    def _embed(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Rotary | None, Rotary | None]:
        """Embeddings (B, T, C), the rotary positions and the sliding layers' own (None: the same)."""
        x = self.tok_emb(tokens)
        scale = self.embed_scale
        if self.cfg.scale_embeddings and x.dtype != torch.float32:  # Gemma rounds sqrt(d_model) to the weights'
            scale = torch.tensor(scale, dtype=x.dtype).item()       # dtype first (bfloat16: 33.94 -> 34.0)
        x = x * scale
        rotary = local = None
        if self.cfg.positions == "learned":
            x = x + self.pos_emb(positions)
        elif self.cfg.positions == "sinusoidal":
            x = x + self.pos_table[positions].to(x.dtype)
        else:
            rotary = Rotary.at(self.rope_cos, self.rope_sin, positions, x.dtype)
            if self.cfg.local_rope_base is not None:
                local = Rotary.at(self.local_rope_cos, self.local_rope_sin, positions, x.dtype)
        return self.drop(x), rotary, local

    def _sliding(self, positions: Tensor, mask: Tensor | None, is_causal: bool,
                 kv_len: int | None) -> tuple[Tensor | None, bool]:
        """The sliding layers' (mask, is_causal): the forward's own restricted to each query's last
        `sliding_window` positions, or the same where no query reaches past its window."""
        window = self.cfg.sliding_window
        keys = mask.size(-1) if mask is not None else kv_len or positions.size(1)
        if keys <= window:
            return mask, is_causal
        return causal_mask(positions, keys, window), False

    def logits(self, hidden: Tensor) -> Tensor:
        """The output layer on final hidden states, with the family's scaling and soft cap."""
        return self.scale_logits(self.lm_head(hidden))

    def scale_logits(self, logits: Tensor) -> Tensor:
        """The family's scaling and soft cap of the output layer's logits."""
        if self.cfg.logits_divisor != 1.0:
            logits = logits / self.cfg.logits_divisor
        if self.cfg.logit_softcap is not None:
            logits = torch.tanh(logits / self.cfg.logit_softcap) * self.cfg.logit_softcap
        return logits

    def _run(
        self,
        tokens: Tensor,
        positions: Tensor,
        *,
        mask: Tensor | None,
        is_causal: bool,
        cache: PagedKVCache | None = None,
        slots: Tensor | None = None,
        kv_len: int | None = None,
        attention_layers: set[int] | None = None,
        states: list[Tensor] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Hidden states after the final norm (B, T, C), and attention probabilities of the layers
        asked for (each (B, H, T, Tk)). `states`: appended the embeddings and each block's output (the logit lens)."""
        x, rotary, local_rotary = self._embed(tokens, positions)
        if states is not None:
            states.append(x)
        maps: dict[int, Tensor] = {}
        view = cache.view(slots, positions, kv_len) if cache is not None else None
        sliding = self._sliding(positions, mask, is_causal, kv_len) if self.sliding_layers else None
        for i, block in enumerate(self.blocks):
            layer_cache = view.layer(i) if view is not None else None
            want = attention_layers is not None and i in attention_layers
            layer_mask, layer_causal, layer_rotary = mask, is_causal, rotary
            if i in self.sliding_layers:
                layer_mask, layer_causal = sliding
                layer_rotary = local_rotary or rotary
            x, probs, _ = block(
                x, mask=layer_mask, is_causal=layer_causal, rotary=layer_rotary, cache=layer_cache, need_weights=want
            )
            if want:
                maps[i] = probs
            if states is not None:
                states.append(x)
        return self.norm_f(x), maps

    # ----------------------------------------------------------------------------------------------
    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) -> logits (B, T, V). Right padding needs no mask: causal attention never lets
        a real token see a later pad."""
        positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        hidden, _ = self._run(tokens, positions, mask=None, is_causal=True)
        return self.logits(hidden)

    def hidden_states(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) -> the final hidden states after the final norm (B, T, C) (right padding as `forward`)."""
        positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        return self._run(tokens, positions, mask=None, is_causal=True)[0]

    def forward_with_attention(
        self, tokens: Tensor, layers: set[int] | None = None
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Like `forward`, also returning the attention probabilities of `layers` (default all)."""
        layers = set(range(self.cfg.n_layers)) if layers is None else set(layers)
        positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        hidden, maps = self._run(tokens, positions, mask=None, is_causal=True, attention_layers=layers)
        return self.logits(hidden), maps

    def new_cache(
        self, num_slots: int, max_len: int | None = None, *, dtype: torch.dtype | None = None,
        num_blocks: int | None = None, block_size: int = 16, window_blocks: int | None = None,
    ) -> PagedKVCache:
        """A paged cache for `num_slots` rows of up to `max_len` positions: `num_blocks` blocks shared by the rows
        through their block tables, or (None) enough blocks for every row's whole length, each row's own for good.
        `window_blocks`: the sliding-window layers (if any) keep theirs in a cache of their own of that many
        blocks (`PagedKVCache.local`, whose rows hold only their window: `model.window_blocks`)."""
        p = self.tok_emb.weight  # not lm_head's: an int8 output layer has no float weight
        max_len = max_len or self.cfg.max_seq_len
        static = num_blocks is None
        if static:
            num_blocks = 1 + num_slots * -(-max_len // block_size)
        local = self.cfg.sliding_layers if window_blocks and not static else ()
        return PagedKVCache(self.cfg.n_layers, num_blocks, block_size, self.cfg.kv_heads, self.cfg.d_head,
                            num_rows=num_slots, max_len=max_len, static_rows=static, dtype=dtype or p.dtype,
                            device=p.device, local_layers=local, local_blocks=window_blocks or 0)

    @torch.inference_mode()
    def prefill(self, tokens: Tensor, lengths: Tensor, cache: PagedKVCache, slots: Tensor,
                start: Tensor | None = None, kv_len: int | None = None) -> Tensor:
        """Right-padded prompts (B, T) with valid `lengths` (B,) into cache rows `slots` (B,), from positions
        `start` (B,) on (default 0: the positions before are already in the cache, e.g. a cached prefix).
        `kv_len`: max(start + lengths) when the caller knows it (reading it from the device waits for it).
        Returns next-token logits (B, V) taken at each prompt's last real token."""
        positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        mask = None
        if start is not None and (kv_len is not None or bool((start > 0).any())):  # attend over the cached ones too
            positions = positions + start[:, None]
            kv_len = kv_len or int((start + lengths).max())
            # `cpu-decode` reads each row's causal rule from its first new position (`Attention.forward`): no mask
            # (which would send the call to SDPA's masked path, half as fast).
            mask = None if self.blocks[0].attn.backend == "cpu-decode" else causal_mask(positions, kv_len)
        else:
            kv_len = None
        hidden, _ = self._run(tokens, positions, mask=mask, is_causal=mask is None, cache=cache, slots=slots,
                              kv_len=kv_len)
        last = hidden[torch.arange(tokens.size(0), device=tokens.device), lengths - 1]
        return self.logits(last)

    def decode_step(
        self, tokens: Tensor | list[int], positions: Tensor | list[int], cache: PagedKVCache,
        slots: Tensor | list[int], kv_len: int | None = None
    ) -> Tensor:
        """One new token per running sequence: tokens (B,) at `positions` (B,) in rows `slots` (B,), tensors on the
        model's device or host lists of ints. Attends over cache positions [0, kv_len) (default: the whole row
        length; a smaller bound that covers every position saves work on CPU). Returns logits (B, V)."""
        if self.fused is not None and self.blocks[0].attn.backend == "cpu-decode" and \
                (not isinstance(tokens, Tensor) or tokens.device.type == "cpu"):
            # One C++ call from host integers: no inference-mode scope to enter, no tensor to build (a step's
            # weights sweep the caches, and each operator around the call then costs several times its usual µs).
            return self.scale_logits(self.fused.step(tokens, positions, cache, slots))
        return self._decode_step_by_layers(tokens, positions, cache, slots, kv_len)

    @torch.inference_mode()
    def _decode_step_by_layers(self, tokens: Tensor | list[int], positions: Tensor | list[int], cache: PagedKVCache,
                               slots: Tensor | list[int], kv_len: int | None) -> Tensor:
        dev = self.tok_emb.weight.device
        tokens, positions, slots = (t if isinstance(t, Tensor) else to_device(t, dev) for t in (tokens, positions, slots))
        kv_len = kv_len or cache.max_len
        positions = positions[:, None]
        mask = None if _attends_to_all(positions, kv_len) else causal_mask(positions, kv_len)
        hidden, _ = self._run(
            tokens[:, None], positions, mask=mask, is_causal=False, cache=cache, slots=slots, kv_len=kv_len
        )
        return self.logits(hidden[:, 0])

    @torch.inference_mode()
    def decode_tokens(self, tokens: Tensor, positions: Tensor, cache: PagedKVCache, slots: Tensor,
                      kv_len: int) -> Tensor:
        """Several new tokens per running sequence (a speculative step: its next token, then its draft):
        tokens (B, T) at positions (B, T), each attending causally over cache positions [0, kv_len). Rows with
        fewer tokens are padded at the end; their padding is computed and ignored (it writes past the row's
        last position, into its own unwritten positions or the null block). Returns logits (B, T, V)."""
        hidden, _ = self._run(tokens, positions, mask=causal_mask(positions, kv_len), is_causal=False, cache=cache,
                              slots=slots, kv_len=kv_len)
        return self.logits(hidden)


def _attends_to_all(positions: Tensor, kv_len: int) -> bool:
    """True on the CPU when every row sits at the last of the `kv_len` positions: the mask would allow
    everything, and SDPA without a mask takes its faster path. (On CUDA the mask stays: deciding would
    cost a host sync, and CUDA graphs want the same ops every step.)"""
    return positions.device.type == "cpu" and int(positions.min()) == kv_len - 1


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
