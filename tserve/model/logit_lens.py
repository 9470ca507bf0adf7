"""The logit lens: what the model would predict if it stopped after each layer. Layer 0 is the embedding
output, layer i the residual stream after block i; each goes through the model's final norm and output head,
and gives a next-token distribution at every position. For an encoder-decoder model, the decoder's layers over
a target (teacher-forced after the decoder start token), attending to the encoded source."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tserve.model.attention import padding_mask
from tserve.model.checkpoint import LoadedModel


@dataclass
class LensLayer:
    layer: int
    top_ids: list[list[int]]  # [position][k]
    top_probs: list[list[float]]


def n_layers(loaded: LoadedModel) -> int:
    """How many lens layers the model has (the embedding output and one per decoder block)."""
    cfg = loaded.config
    return 1 + (cfg.n_decoder_layers if loaded.architecture == "seq2seq" else cfg.n_layers)


@torch.inference_mode()
def logit_lens(loaded: LoadedModel, input_ids: Sequence[int], layers: Sequence[int], top_k: int,
               source_ids: Sequence[int] | None = None) -> list[LensLayer]:
    """Top-`top_k` next tokens at every position of `input_ids` (the decoder's inputs: for a translator the
    start token then the target) after each of `layers`."""
    model, dev = loaded.model, loaded.device
    tokens = torch.tensor([list(input_ids)], device=dev)
    positions = torch.arange(tokens.size(1), device=dev)[None]
    states: list[Tensor] = []
    if loaded.architecture == "seq2seq":
        src = torch.tensor([list(source_ids or [])], device=dev)
        src_len = torch.tensor([src.size(1)], device=dev)
        memory, _ = model.encode(src, src_len)
        x, rotary = model._embed(tokens, positions, "dec")
        context_mask = padding_mask(src_len, src.size(1))
        self_mask, is_causal = model.decoder_self_mask(positions, x.dtype)  # T5's relative bias, as decode has it
        states.append(x)
        for block in model.decoder:
            x, _, _ = block(x, mask=self_mask, is_causal=is_causal, rotary=rotary, context=memory,
                            context_mask=context_mask)
            states.append(x)
        head = lambda h: model._logits(model.dec_norm(h))  # noqa: E731
    else:
        model._run(tokens, positions, mask=None, is_causal=True, states=states)
        head = lambda h: model.logits(model.norm_f(h))  # noqa: E731
    out = []
    for layer in layers:
        probs = torch.softmax(head(states[layer][0]).float(), dim=-1)
        values, ids = torch.topk(probs, k=min(top_k, probs.size(-1)), dim=-1)
        out.append(LensLayer(layer, ids.tolist(), values.tolist()))
    return out
