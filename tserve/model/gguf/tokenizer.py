"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`, `tokenizer.chat_template`) as a Hugging Face
`tokenizers.Tokenizer` in our `HFTokenizer`, giving the ids the original tokenizer.json gives:

    gpt2     byte-level BPE: tokens and merges; the pre-tokenizer's regex named by `tokenizer.ggml.pre`
    llama    SentencePiece BPE with byte fallback: tokens and scores (merges are rebuilt from the scores, as
             transformers' SentencePiece converter does), Metaspace "first" as transformers writes it

Token types (llama.cpp's): 3 control tokens are special added tokens, 4 user-defined ones plain added tokens.
bos / eos / unk / pad ids, add_bos / add_eos and the chat template become tokenizer_config.json's fields."""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from tserve.model.importers.base import CheckpointError
from tserve.model.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (GPT-4o's; Phi-4-mini's tokenizer.json, llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O): a word is an optional
# non-letter, then upper-case letters and lower-case ones in either order of runs ("HelloWorld" -> "Hello", "World"),
# its contraction attached; digits in threes; punctuation runs take trailing newlines and slashes.
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# `tokenizer.ggml.pre` -> (normalizer, pre-tokenizer, ignore_merges), as the families' tokenizer.json files have
# them (Llama 3's BPE skips the merges of a word that is a token; Qwen2's normalizes to NFC first).
PRE_TOKENIZERS: dict[str, Any] = {
    "default": lambda: (None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    "gpt-2": lambda: (None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    "llama-bpe": lambda: (None, _split_then_bytes(_LLAMA3_REGEX), True),
    "qwen2": lambda: (normalizers.NFC(), _split_then_bytes(_QWEN2_REGEX), False),
    "gpt-4o": lambda: (None, _split_then_bytes(_GPT4O_REGEX), False),
    "smollm": lambda: (None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False)]), False),
}
# The names llama.cpp gives the same pre-tokenizers (`llama_vocab::impl::load`).
PRE_TOKENIZERS |= {name: PRE_TOKENIZERS["llama-bpe"] for name in ("llama3", "llama-v3", "smaug-bpe")}
PRE_TOKENIZERS["deepseek-r1-qwen"] = PRE_TOKENIZERS["qwen2"]
PRE_TOKENIZERS["llama4"] = PRE_TOKENIZERS["gpt-4o"]
# StarCoder's and Refact's pre-tokenizers are SmolLM's: llama.cpp splits all three alike (digits one by one).
PRE_TOKENIZERS |= {name: PRE_TOKENIZERS["smollm"] for name in ("starcoder", "refact")}
# Tokens that end a turn, which llama.cpp ends generation at besides eos (`llama_vocab`'s end-of-generation list).
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
               "<|end_of_text|>", "<end_of_utterance>")


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE's merges from its pieces' scores: every split of a piece into two pieces, the
    piece's score ordering them (transformers' `SentencePieceExtractor`)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _token(meta: dict[str, Any], key: str, tokens: list[str], file: object) -> str | None:
    i = meta.get(key)
    if i is None:
        return None
    if not 0 <= int(i) < len(tokens):
        raise CheckpointError(f"{file}: {key} {i} is not an id of its {len(tokens)} tokens")
    return tokens[int(i)]


def gguf_tokenizer(meta: dict[str, Any], file: object) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{file}: no tokenizer.ggml.tokens (a GGUF file without its tokenizer)")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{file}: {len(types)} token types for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise CheckpointError(f"{file}: tokenizer.ggml.pre {pre!r} is not supported "
                                  f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        normalizer, pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]()
        try:
            tok = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        except Exception as exc:  # tokenizers raises a bare Exception for merges outside the vocabulary
            raise CheckpointError(f"{file}: its BPE vocabulary and merges do not fit together ({exc})") from exc
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(f"{file}: a SentencePiece tokenizer needs one score per token")
        unk = _token(meta, "tokenizer.ggml.unknown_token_id", tokens, file)
        tok = tokenizers.Tokenizer(models.BPE(vocab, sentencepiece_merges(tokens, scores), unk_token=unk,
                                              fuse_unk=True, byte_fallback=True))
        # A space in front of the text unless the file says not (`add_space_prefix`: false for some SentencePiece
        # models, whose tokenizer.json then says prepend_scheme "never"); decoding takes off only a space that
        # encoding put there (transformers' converter and llama.cpp's detokenizer do the same).
        space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if space_prefix else
                                                     "never", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if space_prefix else [])])
    else:
        raise CheckpointError(f"{file}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t, kind_ in zip(tokens, types, strict=True) if kind_ == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind_ in zip(tokens, types, strict=True) if kind_ == USER_DEFINED])
    config = {
        "bos_token": _token(meta, "tokenizer.ggml.bos_token_id", tokens, file),
        "eos_token": _token(meta, "tokenizer.ggml.eos_token_id", tokens, file),
        "unk_token": _token(meta, "tokenizer.ggml.unknown_token_id", tokens, file),
        "pad_token": _token(meta, "tokenizer.ggml.padding_token_id", tokens, file),
        # llama.cpp's defaults where the file does not say: SentencePiece vocabularies add bos, BPE ones not.
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    # Named templates (a `tool_use` one) are written by llama.cpp's converter as `tokenizer.chat_template.NAME`,
    # listed in `tokenizer.chat_templates`: read back as transformers' list of named templates.
    named = [{"name": n, "template": meta[f"tokenizer.chat_template.{n}"]}
             for n in meta.get("tokenizer.chat_templates") or [] if meta.get(f"tokenizer.chat_template.{n}")]
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = [{"name": "default", "template": template}, *named] if named else template
    elif named:
        config["chat_template"] = named
    return HFTokenizer(tok, config)


def end_ids(meta: dict[str, Any]) -> list[int]:
    """Every id that ends a generation: eos, eot and eom ids, and the control tokens that end a turn
    (`END_OF_TURN`), as llama.cpp stops at them."""
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    ids += [i for i, (t, kind) in enumerate(zip(tokens, types, strict=False)) if kind == CONTROL and t in END_OF_TURN]
    return sorted(set(ids))
