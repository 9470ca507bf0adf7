"""Attention maps of any of the three model kinds, for debugging: which tokens (or image patches) each
head of each layer attended to.

The weights come from a separate forward pass on the `math` path (the serving kernels such as FlashAttention
never materialise them), for the requested layers only; nothing here touches a KV cache, so it can run
beside a serving engine. Modules are named `decoder.self`, `encoder.self` and `decoder.cross`
(query = target tokens, key = source tokens); a ViT's tokens are `[CLS]` and `patch(r,c)`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tserve.model.checkpoint import LoadedModel
from tserve.model.config import Seq2SeqConfig, ViTConfig
from tserve.model.decoding import translate


@dataclass
class AttentionMap:
    module: str
    layer: int
    query_tokens: list[str]
    key_tokens: list[str]
    weights: Tensor  # (heads, query, key), float32, rows sum to 1

    def to_dict(self) -> dict:
        return {"module": self.module, "layer": self.layer, "query_tokens": self.query_tokens,
                "key_tokens": self.key_tokens, "weights": self.weights.tolist()}


def _existing(what: str, asked: Sequence[int] | None, count: int) -> list[int]:
    if asked is None:
        return list(range(count))
    if not asked:  # an empty list selects nothing; leaving the field out selects all
        raise ValueError(f"{what}: give at least one of 0 to {count - 1}, or leave the field out for all {count}")
    bad = [i for i in asked if not 0 <= i < count]
    if bad:
        raise ValueError(f"{what} {bad} do not exist: this model has {count} {what}, numbered 0 to {count - 1}")
    return list(asked)


def layer_selection(asked: Sequence[int] | None, count: int) -> list[int]:
    """The layers a client asked for out of `count` (None: all), in its order, which the answers of
    `/v1/attention`, `return_attention` and `/v1/logit_lens` keep; a layer named twice is a ValueError naming it."""
    layers = _existing("layers", asked, count)
    twice = sorted(i for i, n in Counter(layers).items() if n > 1)
    if twice:
        raise ValueError(f"layers {twice} named more than once: name each layer once")
    return layers


def layer_counts(loaded: LoadedModel) -> dict[str, int]:
    """Layers per attention module of this kind of model, for validation and for the viewer."""
    cfg = loaded.config
    if isinstance(cfg, Seq2SeqConfig):
        return {"encoder.self": cfg.n_encoder_layers, "decoder.self": cfg.n_decoder_layers,
                "decoder.cross": cfg.n_decoder_layers}
    return {"encoder.self" if isinstance(cfg, ViTConfig) else "decoder.self": cfg.n_layers}


def weight_count(loaded: LoadedModel, layers: Sequence[int] | None, heads: Sequence[int] | None,
                 n_tokens: int = 0, n_target: int = 0) -> int:
    """How many weights the maps of a selection hold, known before any model work: `n_tokens` is the LM's
    sequence or the translation's source length, `n_target` the translation's target length without eos
    (a ViT's token count comes from its config)."""
    layers, heads = check_selection(loaded, layers, heads)
    cfg = loaded.config

    def selected(module: str) -> int:
        return sum(1 for i in layers if i < layer_counts(loaded)[module]) * len(heads)

    if isinstance(cfg, Seq2SeqConfig):
        t = min(n_target + 1, cfg.max_target_len)  # the decoder reads its start token first
        return (selected("encoder.self") * n_tokens * n_tokens + selected("decoder.self") * t * t
                + selected("decoder.cross") * t * n_tokens)
    if isinstance(cfg, ViTConfig):
        n_tokens = cfg.grid_size**2 + cfg.n_prefix_tokens  # [CLS] (DeiT: [DIST]) and the patches
    return selected(next(iter(layer_counts(loaded)))) * n_tokens * n_tokens


def check_selection(loaded: LoadedModel, layers: Sequence[int] | None,
                    heads: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """Validated (layers, heads); ValueError names what exists."""
    n_layers = max(layer_counts(loaded).values())
    return layer_selection(layers, n_layers), sorted(set(_existing("heads", heads, loaded.config.n_heads)))


def _maps(module: str, per_layer: dict[int, Tensor], layers: list[int], heads: list[int], q_tokens: list[str],
          k_tokens: list[str], n_layers: int) -> list[AttentionMap]:
    idx = torch.tensor(heads)
    return [AttentionMap(module, i, q_tokens, k_tokens, per_layer[i][0, idx].float().cpu())
            for i in layers if i < n_layers]


def lm_attention(loaded: LoadedModel, text: str, layers: Sequence[int] | None = None,
                 heads: Sequence[int] | None = None) -> list[AttentionMap]:
    ids = loaded.tokenizer.encode(text)
    if not ids:
        raise ValueError("the input is empty after tokenization")
    if len(ids) > loaded.config.max_seq_len:
        raise ValueError(f"the input has {len(ids)} tokens; this model takes at most {loaded.config.max_seq_len}")
    return lm_attention_ids(loaded, ids, layers, heads)


@torch.inference_mode()
def lm_attention_ids(loaded: LoadedModel, ids: list[int], layers: Sequence[int] | None = None,
                     heads: Sequence[int] | None = None, first_query: int = 0) -> list[AttentionMap]:
    """Maps of a token sequence; `first_query` > 0 keeps only the rows of the later tokens (e.g. the
    generated ones after a prompt)."""
    layers, heads = check_selection(loaded, layers, heads)
    _, per_layer = loaded.model.forward_with_attention(torch.tensor([ids], device=loaded.device), set(layers))
    tokens = loaded.tokenizer.tokens(ids)
    maps = _maps("decoder.self", per_layer, layers, heads, tokens, tokens, loaded.config.n_layers)
    for m in maps:
        m.query_tokens, m.weights = m.query_tokens[first_query:], m.weights[:, first_query:]
    return maps


@torch.inference_mode()
def translation_attention(loaded: LoadedModel, source: str, target: str | None = None,
                          layers: Sequence[int] | None = None,
                          heads: Sequence[int] | None = None) -> tuple[list[AttentionMap], str]:
    """Maps of the model reading `source` and producing `target` (default: its own translation, with the
    checkpoint's decoding defaults, as the translation engine gives it). Returns the maps and the target
    text used."""
    check_selection(loaded, layers, heads)
    cfg, tok = loaded.config, loaded.tokenizer
    src = tok.encode(source)
    if len(src) > cfg.max_source_len:
        raise ValueError(f"the input has {len(src)} tokens; this model takes at most {cfg.max_source_len}")
    if target is None:
        target_ids = [t for t in translate(loaded, [src])[0].output_ids if t != cfg.eos_token_id]
        target = tok.decode(target_ids)
    else:
        target_ids = [t for t in tok.encode_target(target) if t != cfg.eos_token_id]
    return translation_attention_ids(loaded, src, target_ids, layers, heads), target


@torch.inference_mode()
def translation_attention_ids(loaded: LoadedModel, src: list[int], target_ids: list[int],
                              layers: Sequence[int] | None = None,
                              heads: Sequence[int] | None = None) -> list[AttentionMap]:
    """Maps of the model reading source ids and producing target ids (teacher-forced; eos dropped)."""
    layers, heads = check_selection(loaded, layers, heads)
    cfg, tok, dev = loaded.config, loaded.tokenizer, loaded.device
    target_ids = [t for t in target_ids if t != cfg.eos_token_id]
    dec_in = [cfg.decoder_start_token_id, *target_ids][: cfg.max_target_len]
    _, att = loaded.model.forward_with_attention(
        torch.tensor([src], device=dev), torch.tensor([len(src)], device=dev), torch.tensor([dec_in], device=dev),
        set(layers))
    src_tokens, tgt_tokens = tok.tokens(src), tok.tokens(dec_in)
    maps = _maps("encoder.self", att.encoder, layers, heads, src_tokens, src_tokens, cfg.n_encoder_layers)
    maps += _maps("decoder.self", att.decoder, layers, heads, tgt_tokens, tgt_tokens, cfg.n_decoder_layers)
    maps += _maps("decoder.cross", att.cross, layers, heads, tgt_tokens, src_tokens, cfg.n_decoder_layers)
    return maps


@torch.inference_mode()
def vit_attention(loaded: LoadedModel, pixels: Tensor, layers: Sequence[int] | None = None,
                  heads: Sequence[int] | None = None) -> list[AttentionMap]:
    """pixels: one preprocessed image (C, H, W)."""
    layers, heads = check_selection(loaded, layers, heads)
    _, per_layer = loaded.model.forward_with_attention(pixels[None].to(loaded.device, loaded.dtype), set(layers))
    tokens = loaded.model.token_names()
    return _maps("encoder.self", per_layer, layers, heads, tokens, tokens, loaded.config.n_layers)


def attention_rollout(maps: list[AttentionMap]) -> Tensor:
    """Abnar & Zuidema's rollout over consecutive layers of one module: heads averaged, the residual
    connection added as identity, rows renormalised, then multiplied through. (Q, K) for the last layer."""
    result = None
    for m in sorted(maps, key=lambda m: m.layer):
        a = m.weights.mean(0)
        a = a + torch.eye(a.size(0), a.size(1))
        a = a / a.sum(-1, keepdim=True)
        result = a if result is None else a @ result
    if result is None:
        raise ValueError("no maps to roll out")
    return result


def to_bertviz(maps: list[AttentionMap]) -> dict:
    """The shapes of transformers' `output_attentions`, which BertViz's `head_view` / `model_view` take:
    per layer a nested list [1][head][query][key], the layers in the order of `maps` (as the client named
    them), plus the tokens. Maps with cross-attention take the encoder-decoder shape."""

    def stack(module: str) -> list:
        return [[m.weights.tolist()] for m in maps if m.module == module]

    def tokens(module: str, side: str) -> list[str]:
        for m in maps:
            if m.module == module:
                return m.query_tokens if side == "query" else m.key_tokens
        return []

    if any(m.module == "decoder.cross" for m in maps):
        return {"encoder_attention": stack("encoder.self"), "decoder_attention": stack("decoder.self"),
                "cross_attention": stack("decoder.cross"), "encoder_tokens": tokens("encoder.self", "query"),
                "decoder_tokens": tokens("decoder.self", "query")}
    module = maps[0].module if maps else "decoder.self"
    return {"attention": stack(module), "tokens": tokens(module, "query")}
