"""Teacher-forced next-token agreement (`tserve eval --quantize ...` reports it for a language model): a model
agrees with itself everywhere, a copy whose output layer is changed agrees less, and only the scored positions
count."""

from __future__ import annotations

import copy

import numpy as np
import torch

from tserve.model.config import DecoderConfig
from tserve.model.decoder import Decoder
from tserve.training.lm import strided_top1_agreement, strided_windows


def test_agreement_counts_the_scored_positions_where_the_top_tokens_match():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=50, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=16)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    stream = np.random.default_rng(0).integers(0, 50, size=101)
    same, count = strided_top1_agreement(model, model, stream, 16, 8)
    _, targets = strided_windows(stream, 16, 8)
    assert same == 1.0 and count == int((targets != -100).sum()) == 100
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight[:, :16] *= -1  # (tied to the embeddings: inputs change too)
    changed, _ = strided_top1_agreement(model, other, stream, 16, 8)
    assert 0.0 < changed < 0.9
