"""The parts of tiny checkpoints that do not depend on their weights: small tokenizers trained on the inline
corpus (`corpus`), in our layout and in opus-mt's, and a Hugging Face checkpoint's tokenizer and config files
copied without its weights. A test or a benchmark then writes weights of the shape it needs beside them."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import sentencepiece as spm

from tserve.testing.corpus import DE, EN, train_byte_bpe


def write_bpe_tokenizer(d: Path, *, add_eos: bool = False, chat_template: str | None = None) -> int:
    """Our layout: tokenizer.json + tokenizer_config.json. Returns the vocabulary size."""
    d.mkdir(parents=True, exist_ok=True)
    tok = train_byte_bpe(["<pad>", "<s>", "</s>", "<unk>"])
    tok.save(str(d / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
              "add_bos_token": not add_eos, "add_eos_token": add_eos}
    if chat_template:
        config["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def _train_spm(lines: list[str], vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 3), model_writer=model, model_type="unigram",
        vocab_size=vocab_size, hard_vocab_limit=False, character_coverage=1.0, unk_id=0, eos_id=1,
        bos_id=-1, pad_id=-1, num_threads=1, minloglevel=2,
    )
    return model.getvalue()


def marian_vocab(*protos: bytes, extra: tuple[str, ...] = ()) -> dict[str, int]:
    """An opus-mt vocab.json over SentencePiece models: </s>, <unk>, every model's pieces once, `extra` tokens
    (a target tag), <pad> last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for proto in protos:
        sp = spm.SentencePieceProcessor(model_proto=proto)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    for token in (*extra, "<pad>"):
        vocab[token] = len(vocab)
    return vocab


def write_marian_tokenizer(d: Path) -> dict[str, int]:
    """opus-mt layout (source.spm, target.spm, vocab.json); returns the vocabulary."""
    d.mkdir(parents=True, exist_ok=True)
    src = _train_spm(EN, 90)
    tgt = _train_spm(DE, 90)
    (d / "source.spm").write_bytes(src)
    (d / "target.spm").write_bytes(tgt)
    vocab = marian_vocab(src, tgt)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"source_lang": "en", "target_lang": "de", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))
    return vocab


# What `save_pretrained` writes of a checkpoint besides its weights (GPT-2's tokenizer is vocab.json and
# merges.txt; Mistral's chat template is a file of its own).
TOKENIZER_AND_CONFIG = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def copy_tokenizer_and_config(checkpoint: Path, d: Path) -> Path:
    """The tokenizer and config files of the Hugging Face checkpoint `checkpoint` (those of `TOKENIZER_AND_CONFIG`
    it has) copied into `d` (created), without its weights."""
    d.mkdir(parents=True, exist_ok=True)
    copied = [shutil.copy2(checkpoint / name, d / name) for name in TOKENIZER_AND_CONFIG if (checkpoint / name).is_file()]
    if not copied:
        raise FileNotFoundError(f"{checkpoint} holds no checkpoint's tokenizer or config")
    return d
