"""Embeddings: one L2-normalised float32 vector per input, from the model's own representations.

- decoder LM: the mean of the final hidden states (after the final norm) over the input's tokens;
- encoder-decoder: the mean of the encoder's output over the source tokens;
- ViT: the class token's final state (after the final norm), which is what the classifier head reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from tserve.model.checkpoint import LoadedModel


def embedding_size(loaded: LoadedModel) -> int:
    """The length of every vector `embed_token_lists` and `embed_pixels` give: the model's width."""
    return loaded.config.d_model


def max_input_tokens(loaded: LoadedModel) -> int:
    """How many tokens a text input may have: the encoder's source length, or a decoder's context."""
    return getattr(loaded.config, "max_source_len", None) or loaded.config.max_seq_len


@torch.inference_mode()
def embed_token_lists(loaded: LoadedModel, token_lists: Sequence[Sequence[int]]) -> Tensor:
    """(N, d_model) embeddings of N token id lists (none empty), as one right-padded batch."""
    lengths = torch.tensor([len(t) for t in token_lists])
    pad = getattr(loaded.config, "pad_token_id", 0) or 0
    tokens = torch.full((len(token_lists), int(lengths.max())), pad, dtype=torch.long)
    for i, t in enumerate(token_lists):
        tokens[i, : len(t)] = torch.tensor(list(t))
    dev = loaded.device
    tokens, lengths = tokens.to(dev), lengths.to(dev)
    if loaded.architecture == "seq2seq":
        states, _ = loaded.model.encode(tokens, lengths)
    else:
        states = loaded.model.hidden_states(tokens)
    keep = (torch.arange(tokens.size(1), device=dev)[None, :] < lengths[:, None]).to(states.dtype)
    mean = (states * keep[:, :, None]).sum(1) / lengths[:, None].to(states.dtype)
    return F.normalize(mean.float(), dim=-1)


@torch.inference_mode()
def embed_pixels(loaded: LoadedModel, pixels: Tensor) -> Tensor:
    """(N, d_model) embeddings of preprocessed images (N, C, H, W)."""
    states = loaded.model.features(pixels.to(loaded.device, loaded.dtype))
    return F.normalize(states.float(), dim=-1)
