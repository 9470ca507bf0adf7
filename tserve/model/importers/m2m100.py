"""M2M100 and NLLB-200 (`M2M100ForConditionalGeneration`): the BART layout (model.importers.marian) with
pre-norm layers, a final norm on each stack, fairseq's sinusoidal positions starting at padding index + 1,
embeddings scaled by sqrt(d_model) (`scale_embedding`) and one vocabulary whose language codes (`eng_Latn`,
`__en__`) pick the target language as the decoder's first token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

from tserve.model.config import Seq2SeqConfig
from tserve.model.importers.base import GenerationDefaults, WeightSource
from tserve.model.importers.common import activation, unsupported
from tserve.model.importers.marian import generation as marian_generation
from tserve.model.importers.marian import layer_weights, shared_embedding

MODEL_TYPES = ("m2m_100",)


def config(raw: dict[str, Any], path: Path) -> Seq2SeqConfig:
    for side in ("attention_heads", "ffn_dim"):
        if raw[f"encoder_{side}"] != raw[f"decoder_{side}"]:
            raise unsupported(path, f"decoder_{side}", raw[f"decoder_{side}"], f"must equal encoder_{side}")
    if not raw.get("tie_word_embeddings", True):
        raise unsupported(path, "tie_word_embeddings", False, "M2M100 shares one embedding with its output layer")
    pad = raw.get("pad_token_id", 1)
    return Seq2SeqConfig(
        vocab_size=raw["vocab_size"], d_model=raw["d_model"], n_heads=raw["encoder_attention_heads"],
        d_ff=raw["encoder_ffn_dim"], n_encoder_layers=raw["encoder_layers"], n_decoder_layers=raw["decoder_layers"],
        max_source_len=raw["max_position_embeddings"], max_target_len=raw["max_position_embeddings"],
        norm_placement="pre", norm_eps=1e-5, activation=activation(raw, "activation_function", "relu", path),
        positions="sinusoidal", sinusoid="fairseq", position_offset=pad + 1, tie_embeddings=True,
        scale_embeddings=bool(raw.get("scale_embedding", True)), final_norm=True, final_logits_bias=False,
        decoder_start_token_id=raw.get("decoder_start_token_id", 2), eos_token_id=raw.get("eos_token_id", 2),
        pad_token_id=pad,
    )


def generation(raw: dict[str, Any], path: Path) -> GenerationDefaults:
    return marian_generation(raw, path)


def weights(cfg: Seq2SeqConfig, hf: WeightSource) -> Iterator[tuple[str, Tensor]]:
    yield "tok_emb.weight", shared_embedding(hf)
    yield from layer_weights(cfg, hf)
    for side, ours in (("encoder", "enc_norm"), ("decoder", "dec_norm")):
        yield f"{ours}.weight", hf[f"{side}.layer_norm.weight"]
        yield f"{ours}.bias", hf[f"{side}.layer_norm.bias"]
