"""Vaswani encoder-decoder (Marian / opus-mt, M2M100 / NLLB and T5 layouts), with cached inference.

Training: `forward(src, src_lengths, tgt)` -> logits (teacher forcing).
Inference: `start(src, src_lengths, cache, cross_slots)` encodes right-padded sources and stores every
decoder layer's cross-attention keys/values once per source, in its cross slot's blocks; `decode_step(...)` then
advances each running hypothesis by one token against its self-attention row and its request's cross slot. Beams
of one request share the cross slot. Both live in one block pool (`model.kv_cache`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tserve.model.attention import Rotary, causal_mask, padding_mask
from tserve.model.config import Seq2SeqConfig
from tserve.model.decoder import _init_weights
from tserve.model.kv_cache import PagedCrossKV, PagedKVCache, SharedSources
from tserve.model.layers import Block, make_norm, sinusoidal_table
from tserve.model.relative_positions import RelativePositionBias


@dataclass
class Seq2SeqCache:
    self_kv: PagedKVCache  # the pool; decoder self-attention: one row (and its block table) per running hypothesis
    cross_kv: PagedCrossKV  # encoder outputs projected per decoder layer, in the same pool: a table per source slot


@dataclass
class Seq2SeqAttention:
    encoder: dict[int, Tensor]  # layer -> (B, H, S, S)
    decoder: dict[int, Tensor]  # layer -> (B, H, T, T)
    cross: dict[int, Tensor]  # layer -> (B, H, T, S)


class Seq2Seq(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig, backend: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        max_len = max(cfg.max_source_len, cfg.max_target_len)
        if cfg.positions == "learned":
            self.enc_pos_emb = nn.Embedding(cfg.max_source_len, cfg.d_model)
            self.dec_pos_emb = nn.Embedding(cfg.max_target_len, cfg.d_model)
        elif cfg.positions == "sinusoidal":
            table = sinusoidal_table(max_len + cfg.position_offset, cfg.d_model, cfg.sinusoid)
            self.register_buffer("pos_table", table[cfg.position_offset:], persistent=False)
        elif cfg.positions == "relative":
            self.enc_rel_bias, self.dec_rel_bias = (
                RelativePositionBias(cfg.relative_buckets, cfg.n_heads, cfg.relative_max_distance, bidirectional)
                for bidirectional in (True, False))
        else:
            cos, sin = Rotary.tables(cfg.d_head, max_len, cfg.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(Block(cfg, backend=backend) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(Block(cfg, cross=True, backend=backend) for _ in range(cfg.n_decoder_layers))
        self.enc_norm = make_norm(cfg) if cfg.final_norm else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.final_logits_bias:
            self.register_buffer("final_logits_bias", torch.zeros(cfg.vocab_size))
        else:
            self.final_logits_bias = None
        self.apply(_init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0

    # ----------------------------------------------------------------------------------------------
    def _embed(self, tokens: Tensor, positions: Tensor, side: str) -> tuple[Tensor, Rotary | None]:
        x = self.tok_emb(tokens) * self.embed_scale
        rotary = None
        if self.cfg.positions == "learned":
            x = x + (self.enc_pos_emb if side == "enc" else self.dec_pos_emb)(positions)
        elif self.cfg.positions == "sinusoidal":
            x = x + self.pos_table[positions].to(x.dtype)
        elif self.cfg.positions == "rope":
            rotary = Rotary.at(self.rope_cos, self.rope_sin, positions, x.dtype)
        return self.drop(x), rotary

    def _self_mask(self, side: str, positions: Tensor, key_len: int, allowed: Tensor, dtype: torch.dtype) -> Tensor:
        """A stack's self-attention mask: `allowed` (boolean), with relative positions the float mask that also
        carries the position bias."""
        if self.cfg.positions != "relative":
            return allowed
        bias = self.enc_rel_bias if side == "enc" else self.dec_rel_bias
        return bias(positions, key_len, allowed, dtype)

    def _logits(self, hidden: Tensor) -> Tensor:
        if self.cfg.output_scale != 1.0:
            hidden = hidden * self.cfg.output_scale
        logits = self.lm_head(hidden)
        return logits if self.final_logits_bias is None else logits + self.final_logits_bias.to(logits.dtype)

    def encode(
        self, src: Tensor, src_lengths: Tensor, attention_layers: set[int] | None = None
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Right-padded source (B, S) -> encoder output (B, S, C) and requested attention maps."""
        positions = torch.arange(src.size(1), device=src.device).expand_as(src)
        x, rotary = self._embed(src, positions, "enc")
        mask = self._self_mask("enc", positions[:1], src.size(1), padding_mask(src_lengths, src.size(1)), x.dtype)
        maps: dict[int, Tensor] = {}
        for i, block in enumerate(self.encoder):
            want = attention_layers is not None and i in attention_layers
            x, probs, _ = block(x, mask=mask, rotary=rotary, need_weights=want)
            if want:
                maps[i] = probs
        return self.enc_norm(x), maps

    def decoder_self_mask(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor | None, bool]:
        """(mask, is_causal) of a teacher-forced decoder's self-attention over `positions` (B, T): T5's relative
        bias carries the causal rule in its mask; other layouts attend causally with no mask."""
        if self.cfg.positions != "relative":
            return None, True
        length = positions.size(1)
        return self._self_mask("dec", positions[:1], length, causal_mask(positions[:1], length), dtype), False

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_lengths: Tensor,
        attention_layers: set[int] | None = None,
        last_layer: int | None = None,
    ) -> tuple[Tensor | None, dict[int, Tensor], dict[int, Tensor]]:
        """Teacher-forced decoder over target inputs (B, T) -> logits (B, T, V), self and cross maps; with
        `last_layer`, no layer after it runs and no logits are computed (None)."""
        positions = torch.arange(tgt.size(1), device=tgt.device).expand_as(tgt)
        x, rotary = self._embed(tgt, positions, "dec")
        context_mask = padding_mask(src_lengths, memory.size(1))
        self_mask, is_causal = self.decoder_self_mask(positions, x.dtype)
        self_maps: dict[int, Tensor] = {}
        cross_maps: dict[int, Tensor] = {}
        for i, block in enumerate(self.decoder):
            want = attention_layers is not None and i in attention_layers
            x, self_probs, cross_probs = block(
                x, mask=self_mask, is_causal=is_causal, rotary=rotary, context=memory, context_mask=context_mask,
                need_weights=want,
            )
            if want:
                self_maps[i], cross_maps[i] = self_probs, cross_probs
            if i == last_layer:
                return None, self_maps, cross_maps
        return self._logits(self.dec_norm(x)), self_maps, cross_maps

    def forward(self, src: Tensor, src_lengths: Tensor, tgt: Tensor) -> Tensor:
        memory, _ = self.encode(src, src_lengths)
        logits, _, _ = self.decode(tgt, memory, src_lengths)
        return logits

    def forward_with_attention(
        self, src: Tensor, src_lengths: Tensor, tgt: Tensor, layers: set[int] | None = None
    ) -> tuple[Tensor, Seq2SeqAttention]:
        """Logits and attention maps of `layers` (default all) of encoder, decoder and cross-attention."""
        enc_layers = set(range(self.cfg.n_encoder_layers)) if layers is None else set(layers)
        dec_layers = set(range(self.cfg.n_decoder_layers)) if layers is None else set(layers)
        memory, enc_maps = self.encode(src, src_lengths, enc_layers)
        logits, self_maps, cross_maps = self.decode(tgt, memory, src_lengths, dec_layers)
        return logits, Seq2SeqAttention(enc_maps, self_maps, cross_maps)

    def cross_attention(self, src: Tensor, src_lengths: Tensor, tgt: Tensor, layers: set[int]) -> dict[int, Tensor]:
        """The decoder's cross-attention maps of `layers` alone, teacher-forced: no encoder maps, no decoder
        layer after the last one asked for, no logits (word alignment reads a few heads; the output layer
        over the vocabulary would cost more than the rest together)."""
        memory, _ = self.encode(src, src_lengths)
        _, _, cross = self.decode(tgt, memory, src_lengths, layers, last_layer=max(layers))
        return cross

    # ----------------------------------------------------------------------------------------------
    def new_cache(
        self,
        num_slots: int,
        num_cross_slots: int | None = None,
        *,
        max_target_len: int | None = None,
        max_source_len: int | None = None,
        dtype: torch.dtype | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
    ) -> Seq2SeqCache:
        """One pool of `num_blocks` blocks for the decoder self-attention of `num_slots` rows and the
        cross-attention keys/values of `num_cross_slots` sources (default `num_slots`), each reached through its
        block table. `num_blocks` None: every row and every source slot its whole length for good (a static cache)."""
        cfg, p = self.cfg, self.tok_emb.weight  # not lm_head's: an int8 output layer has no float weight
        kw = dict(dtype=dtype or p.dtype, device=p.device)
        target_len = max_target_len or cfg.max_target_len
        source_len = max_source_len or cfg.max_source_len
        num_cross_slots = num_cross_slots or num_slots
        static = num_blocks is None
        row_blocks = -(-target_len // block_size)
        if static:
            num_blocks = 1 + num_slots * row_blocks + num_cross_slots * -(-source_len // block_size)
        pool = PagedKVCache(cfg.n_decoder_layers, num_blocks, block_size, cfg.n_heads, cfg.d_head,
                            num_rows=num_slots, max_len=target_len, static_rows=static, **kw)
        cross = PagedCrossKV(pool, num_cross_slots, source_len,
                             static_from=1 + num_slots * row_blocks if static else None)
        return Seq2SeqCache(pool, cross)

    @torch.inference_mode()
    def start(self, src: Tensor, src_lengths: Tensor, cache: Seq2SeqCache, cross_slots: Tensor) -> None:
        """Encode sources (B, S) and store each decoder layer's cross K/V in `cross_slots` (B,)."""
        memory, _ = self.encode(src, src_lengths)
        cache.cross_kv.write(cross_slots, [block.cross_attn.project_kv(memory) for block in self.decoder],
                             src_lengths)

    @torch.inference_mode()
    def decode_step(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: Seq2SeqCache,
        slots: Tensor,
        cross_slots: Tensor,
        *,
        kv_len: int | None = None,
        src_len: int | None = None,
    ) -> Tensor:
        """One token per hypothesis: tokens (B,) at `positions` (B,), self-attention in `slots` (B,),
        cross-attention over `cross_slots` (B,). `kv_len`/`src_len` bound the cache extents attended
        (default: the whole static caches). Returns logits (B, V)."""
        kv_len = kv_len or cache.self_kv.max_len
        src_len = src_len or cache.cross_kv.max_len
        positions = positions[:, None]
        x, rotary = self._embed(tokens[:, None], positions, "dec")
        mask = self._self_mask("dec", positions, kv_len, causal_mask(positions, kv_len), x.dtype)
        if self.decoder[0].cross_attn.backend == "cpu-decode":  # its kernel reads each source from the pool
            shared, context_mask, context_kv = None, None, cache.cross_kv.in_place(cross_slots)
        else:
            shared = SharedSources.of(cross_slots)
            if shared is not None:  # beams: each source read once, its rows attend as one query block
                cross_slots = shared.slots
            context_kv = cache.cross_kv.reader(cross_slots, src_len)
            context_mask = padding_mask(cache.cross_kv.lengths[cross_slots], src_len)
        view = cache.self_kv.view(slots, positions, kv_len)
        for i, block in enumerate(self.decoder):
            x, _, _ = block(
                x,
                mask=mask,
                rotary=rotary,
                cache=view.layer(i),
                context_kv=context_kv(i),
                context_mask=context_mask,
                shared_sources=shared,
            )
        return self._logits(self.dec_norm(x[:, 0]))
