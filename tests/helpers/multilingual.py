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
from tserve.testing.corpus import DE, EN

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


# --------------------------------------------------------------------------------------------------
# T5 / MADLAD-400
# --------------------------------------------------------------------------------------------------
TAGS = {"en": "<2en>", "de": "<2de>", "fr": "<2fr>"}


def _t5_tokenizer(d: Path):  # noqa: ANN202 - transformers' T5Tokenizer
    """A Unigram vocabulary in T5's layout (<pad> 0, </s> 1, <unk> 2; eos appended to every source) with the
    lexicon's words whole and every character, and MADLAD-400's target tags as added tokens."""
    from transformers import T5Tokenizer

    words = [*fixture_training.LEXICON, *fixture_training.LEXICON.values()]
    chars = sorted({c for t in EN + DE + words for c in t if not c.isspace()})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *((f"▁{w}", -2.0) for w in words), ("▁", -4.0),
             *((c, -6.0) for c in chars)]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.add_tokens(list(TAGS.values()))
    tok.save_pretrained(d)
    return tok


def build_t5(d: Path, seed: int = 0, train: bool = True, steps: int = 3000, max_words: int = 5,
             feed_forward_proj: str = "gated-gelu", tied: bool = False) -> Path:
    """A tiny MADLAD-400-shaped checkpoint (`T5ForConditionalGeneration`, T5 v1.1: gated GELU, an output layer
    of its own, config.json saying `tie_word_embeddings: false` as MADLAD's does) that has learnt the lexicon
    both ways, the target language's tag in front of the source. T5's 32 relative position buckets (exact up to
    distance 7 in the encoder, where a word's place is all that tells it from the others: cross-attention has
    no positions) but logarithmic from 8 to 64, so that the tests' longer sources reach those too. `tied`,
    `feed_forward_proj="relu"`: the original T5 layout (the output layer is the embedding, scaled)."""
    import transformers
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    tok = _t5_tokenizer(d)
    cfg = transformers.T5Config(
        vocab_size=len(tok), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=64, dropout_rate=0.0,
        feed_forward_proj=feed_forward_proj, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(cfg)
    if not tied:  # transformers ties T5's output layer when it builds one; MADLAD's has its own
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    if train:
        eos = tok.eos_token_id

        def source(text: str, lang: str) -> list[int]:
            return tok(f"{TAGS['de' if lang == 'en' else 'en']} {text}").input_ids

        def target(text: str, lang: str) -> list[int]:
            return [*tok(text, add_special_tokens=False).input_ids, eos]

        def logits(src: torch.Tensor, lengths: torch.Tensor, dec_in: torch.Tensor) -> torch.Tensor:
            mask = (torch.arange(src.size(1))[None, :] < lengths[:, None]).long()
            return model(input_ids=src, attention_mask=mask, decoder_input_ids=dec_in).logits

        # A lower rate than the other fixtures': T5's scores are not scaled down, and at 5e-3 it degenerates.
        fixture_training.train_translator_both_ways(model, source, target, logits, cfg.pad_token_id,
                                                    cfg.decoder_start_token_id, seed, steps, max_words, lr=2e-3)
    model.eval()
    model.config.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    raw.pop("scale_decoder_outputs", None)
    (d / "config.json").write_text(json.dumps(raw | {"tie_word_embeddings": tied}, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
             and not (tied and k == "lm_head.weight")}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d
