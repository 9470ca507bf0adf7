"""Tokenizer training with Hugging Face `tokenizers`, producing our `HFTokenizer` (tokenizer.json +
tokenizer_config.json), so a trained tokenizer is saved and loaded like any other checkpoint's.

Translation: one BPE vocabulary shared by English and German (tied embeddings need one id space),
SentencePiece-style `▁` word boundaries so decoding restores spaces exactly, NFKC normalisation, and
`<pad>`, `<s>`, `</s>`, `<unk>` at ids 0-3. Sources get `</s>` appended (as Marian models do); the decoder
starts from `<s>`.

Language model: byte-level BPE (GPT-2 style) that can encode any text without `<unk>`, with
`<|endoftext|>` as document separator (bos/eos), no special tokens added by `encode`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from tserve.model.tokenizer import HFTokenizer

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ENDOFTEXT = "<|endoftext|>"


def train_translation_tokenizer(texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2,
                                limit_alphabet: int = 300) -> HFTokenizer:
    """Shared EN/DE BPE. `limit_alphabet` keeps rare symbols out of the base alphabet (they map to
    `<unk>`), so the merges are spent on real words."""
    tok = HFBackend(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, limit_alphabet=limit_alphabet,
                                  special_tokens=[PAD, BOS, EOS, UNK], show_progress=False)
    tok.train_from_iterator(_strings(texts), trainer)
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
              "add_bos_token": False, "add_eos_token": True}
    return HFTokenizer(tok, config)


def train_lm_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> HFTokenizer:
    """Byte-level BPE for English text; `<|endoftext|>` (id 0) separates documents."""
    tok = HFBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_strings(texts), trainer)
    config = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT, "pad_token": ENDOFTEXT,
              "add_bos_token": False, "add_eos_token": False}
    return HFTokenizer(tok, config)


def encode_batch(tokenizer: HFTokenizer, texts: list[str]) -> list[list[int]]:
    """Fast batch encoding (Rust, parallel) without special tokens."""
    return [e.ids for e in tokenizer.backend.encode_batch(texts, add_special_tokens=False)]


def _strings(texts: Iterable[str]) -> Iterator[str]:
    for t in texts:
        if t:
            yield t
