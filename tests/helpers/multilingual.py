"""A tiny NLLB-200 checkpoint (`M2M100ForConditionalGeneration` with NLLB's tokenizer), as `save_pretrained`
writes it: a Metaspace BPE with three of NLLB's language codes (eng_Latn, deu_Latn, fra_Latn), the source
code first and eos last on the source side, the target code forced as the decoder's first token. It has
learnt `fixture_training.LEXICON` both ways, English to German and German to English, in one model
(committed under tests/fixtures/hf-nllb, `factories.RECIPES`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.helpers import fixture_training
from tests.helpers.factories import DE, EN

CODES = {"en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn"}


def _tokenizer(d: Path):  # noqa: ANN202 - transformers' NllbTokenizer
    from transformers import NllbTokenizer

    words = [*fixture_training.LEXICON, *fixture_training.LEXICON.values()]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  show_progress=False)
    bpe.train_from_iterator((EN + DE + [" ".join(words)]) * 3, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    tok = NllbTokenizer(vocab=model["vocab"], merges=merges, extra_special_tokens=list(CODES.values()),
                        src_lang="eng_Latn")
    tok.save_pretrained(d)
    return tok


def build(d: Path, seed: int = 0, train: bool = True, steps: int = 1500, max_words: int = 5) -> Path:
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(d)
    cfg = transformers.M2M100Config(
        vocab_size=len(tok), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    torch.manual_seed(seed)
    model = transformers.M2M100ForConditionalGeneration(cfg)
    if train:
        eos = tok.eos_token_id

        def source(text: str, lang: str) -> list[int]:
            return [tok.convert_tokens_to_ids(CODES[lang]), *tok(text, add_special_tokens=False).input_ids, eos]

        def logits(src: torch.Tensor, lengths: torch.Tensor, dec_in: torch.Tensor) -> torch.Tensor:
            mask = (torch.arange(src.size(1))[None, :] < lengths[:, None]).long()
            return model(input_ids=src, attention_mask=mask, decoder_input_ids=dec_in).logits

        # The target side: the language code first (forced when translating), then the words and eos.
        fixture_training.train_translator_both_ways(model, source, source, logits, cfg.pad_token_id,
                                                    cfg.decoder_start_token_id, seed, steps, max_words)
    model.eval().save_pretrained(d)
    return d


def build_m2m100(d: Path, seed: int = 0) -> Path:
    """A tiny M2M100 checkpoint in the facebook/m2m100_418M layout (sentencepiece.bpe.model + vocab.json, no
    tokenizer.json; WMT21's eight language codes), random weights: transformers' M2M100Tokenizer writes it."""
    import io

    import sentencepiece as spm
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((EN + DE) * 3), model_writer=model, model_type="unigram", vocab_size=120,
        hard_vocab_limit=False, character_coverage=1.0, unk_id=3, bos_id=0, eos_id=2, pad_id=1, num_threads=1,
        minloglevel=2)
    (d / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = transformers.M2M100Tokenizer(str(d / "vocab.json"), str(d / "sentencepiece.bpe.model"),
                                       language_codes="wmt21", src_lang="en")
    tok.save_pretrained(d)
    cfg = transformers.M2M100Config(
        vocab_size=len(vocab) + 8 + tok.num_madeup_words, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, dropout=0.0)
    torch.manual_seed(seed)
    transformers.M2M100ForConditionalGeneration(cfg).eval().save_pretrained(d)
    return d
