"""One tokenizer interface over HF ``tokenizers`` files and Marian SentencePiece files.

Serving and training code should not care whether a checkpoint came with tokenizer.json, GPT-2's
vocab.json + merges.txt or an opus-mt directory. The wrappers reproduce the ids of the matching
``transformers`` tokenizer exactly, because a model only works with the ids it was trained on.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from tserve.model.chat_template import continued

__all__ = ["Tokenizer", "HFTokenizer", "MarianTokenizer", "M2M100Tokenizer", "load_tokenizer"]

SPIECE_UNDERLINE = "▁"
_LANGUAGE_TOKEN = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}|__[a-z]{2,3}(?:_[A-Za-z]+)?__")  # eng_Latn, __en__
_LANGUAGE_TAG = re.compile(r"<2[a-z]{2,3}(?:_[A-Z][a-z]{3})?>")  # MADLAD-400's <2de>, <2zh_Latn>
GPT2_SPECIAL = "<|endoftext|>"
# Renders bytes that are not valid UTF-8 as "<0xF0>", the way SentencePiece names byte pieces.
codecs.register_error(
    "tokenizer_hexbyte", lambda e: ("".join(f"<0x{b:02X}>" for b in e.object[e.start : e.end]), e.end)
)
_HEX_BYTE = re.compile(r"<0x([0-9A-F]{2})>")


def token_bytes(token: str) -> bytes:
    """The bytes a readable token string (`Tokenizer.id_to_token`) stands for: a byte named "<0xE6>" (a piece of
    a character split over tokens, as byte-level BPE and SentencePiece's byte fallback both name it) is that one
    byte, the rest its UTF-8. OpenAI's logprobs carry these bytes so that a client can join a character's pieces."""
    parts = _HEX_BYTE.split(token)  # text, byte, text, byte, ..., text
    return b"".join(bytes([int(part, 16)]) if i % 2 else part.encode("utf-8") for i, part in enumerate(parts))


def _read_json(path: Path, default: Any = None) -> Any:
    """Parse a JSON file; optional files (configs) return ``default`` when missing."""
    if default is not None and not path.is_file():
        return default
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")


def _token_str(value: Any) -> str | None:
    """Special tokens appear in configs as plain strings or as serialized ``AddedToken`` dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: byte-level BPE stores every byte as a printable char."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    shifted = [b for b in range(256) if b not in printable]  # stored as chr(256 + n)
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(shifted)}


def _chat_template_of(config: dict[str, Any], name: str = "default") -> str | None:
    """transformers stores a template string, or a list of named templates: "default" is used, and "tool_use" for
    a request with tools where there is one (`name`; None where the list has no template of that name)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None) if name == "default" else named.get(name)
    elif name != "default":
        return None
    return template if isinstance(template, str) and template else None


class Tokenizer(ABC):
    """Common interface; subclasses fill in the special-token ids, the template and the codec methods.

    For a seq2seq model ``encode`` is the source side and ``encode_target``/``decode`` are the target
    side, so generation code can use ``decode`` unconditionally on what the model produced.
    """

    _bos_id: int | None = None
    _eos_id: int | None = None
    _pad_id: int | None = None
    _unk_id: int | None = None
    _special: set[int]
    _special_tokens: dict[str, str | None]  # "bos_token" -> "<s>", exposed to chat templates
    _chat_template: str | None = None
    _tool_template: str | None = None  # a list of named templates' "tool_use", for requests with tools

    def backend_json(self) -> str | None:
        """The tokenizer as a Hugging Face tokenizer.json (what grammar libraries read), if it has one."""
        return None

    @property
    def language_codes(self) -> dict[str, int]:
        """A multilingual translator's language codes and their ids; empty for every other tokenizer."""
        return {}

    @property
    def target_tagged(self) -> bool:
        return False

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (what the embedding table must cover)."""

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    @property
    def decodes_bytes_lossily(self) -> bool:
        """True when `decode` reads its ids' bytes as one UTF-8 string, each broken sequence one U+FFFD (a
        ByteLevel decoder): later ids can then turn only a text's last U+FFFD into a character, never the ones
        before it. Other decoders (SentencePiece's byte fallback: a U+FFFD for each byte of a run of byte pieces
        that is not UTF-8 as a whole) may change a run of them."""
        return False

    @property
    def special_ids(self) -> set[int]:
        """Ids dropped by ``decode(skip_special_tokens=True)``."""
        return set(self._special)

    def decode_stream(self, context: list[int], skip_special_tokens: bool = True) -> Callable[[int], str | None] | None:
        """An incremental decoder in the tokenizer's own library, primed with `context` (ids whose text is already
        out): each call takes the next id (never one that `decode` drops) and returns the text it completes, None
        while it completes none. `IncrementalDetokenizer` steps it instead of decoding its window twice a token.
        None: this tokenizer has none."""
        return None

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, or None when there is none or jinja2 is unavailable to render it."""
        return self._chat_template if importlib.util.find_spec("jinja2") else None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode model input (the source side of a seq2seq model)."""

    def encode_target(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode decoder-side text (labels of a seq2seq model); identical to ``encode`` for shared tokenizers."""
        return self.encode(text, add_special_tokens)

    def source_in(self, text: str, languages: tuple[str | None, str] | None) -> list[int]:
        """A translator's source: a multilingual model's in its language (NLLB, M2M100: the source code), or
        behind the target's tag (MADLAD-400); `languages` (source, target) are the model's own codes."""
        if languages is None:
            return self.encode(text)
        return self.encode_with_language(text, languages[1] if self.target_tagged else languages[0])

    def target_prefix(self, languages: tuple[str | None, str] | None) -> list[int]:
        """What a multilingual translator's target starts with: the target language's code, forced as the first
        token (NLLB, M2M100); nothing for a one-pair or a tagged model."""
        if languages is None or self.target_tagged:
            return []
        return [self.language_codes[languages[1]]]

    def encode_with_language(self, text: str, code: str) -> list[int]:
        raise ValueError("this tokenizer has no language codes")

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode generated ids (the target side of a seq2seq model)."""

    @abstractmethod
    def id_to_token(self, i: int) -> str:
        """Readable text of one token (spaces shown as spaces), for labelling attention maps and logprobs."""

    def tokens(self, ids: Iterable[int]) -> list[str]:
        """Readable token strings for a sequence of ids."""
        return [self.id_to_token(int(i)) for i in ids]

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write the files ``load_tokenizer`` needs into ``directory`` (created if missing)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> str:
        """Render chat messages into a prompt string with the tokenizer's Jinja template.

        ``add_generation_prompt`` defaults to True (unlike transformers) because the server renders
        chats in order to generate the assistant's reply. Special tokens are available to the template
        as ``bos_token`` etc., like in transformers, so hub templates render the same; so are ``tools``
        (OpenAI's function definitions), for the templates that describe them to the model.
        ``continue_final_message``: the chat ends inside its final message, for the model to go on with it.
        """
        if self._chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json has no 'chat_template')"
            )
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise ValueError("rendering the chat template needs jinja2, which is not installed") from e

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # noqa: DTZ005 (local time, as HF)
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        template = self._tool_template if tools and self._tool_template else self._chat_template
        # a role this tokenizer has no token for is left undefined (it renders as nothing), as transformers has it
        specials = {k: v for k, v in self._special_tokens.items() if v is not None}
        try:
            rendered = env.from_string(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                tools=tools, **specials)
        except (TemplateError, TypeError) as e:  # TypeError: e.g. a template that adds to content that is null
            raise ValueError(f"chat template rendering failed: {e}") from e
        return continued(rendered, messages) if continue_final_message else rendered


class HFTokenizer(Tokenizer):
    """Wraps a ``tokenizers.Tokenizer``; special-token roles come from a tokenizer_config.json dict.

    ``config`` holds ``bos_token``/``eos_token``/``pad_token``/``unk_token`` (strings or AddedToken
    dicts), ``add_bos_token``/``add_eos_token`` and ``chat_template``. With either flag present the
    flags decide what ``encode`` adds (a missing one counts as False) and the tokenizer.json
    post-processor is bypassed, so nothing is added twice; without them the post-processor decides
    (BERT's [CLS]/[SEP], GPT-2's nothing).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any] | None = None) -> None:
        self._tok = tokenizer
        self._config = cfg = dict(config or {})
        names = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        if not (names["bos_token"] or names["eos_token"]) and tokenizer.token_to_id(GPT2_SPECIAL) is not None:
            for k in ("bos_token", "eos_token", "unk_token"):  # GPT-2's convention, as in transformers
                names[k] = names[k] or GPT2_SPECIAL
        self._special_tokens = names
        ids = [None if t is None else tokenizer.token_to_id(t) for t in names.values()]
        self._bos_id, self._eos_id, self._pad_id, self._unk_id = ids
        self._explicit_flags = "add_bos_token" in cfg or "add_eos_token" in cfg
        self._add_bos, self._add_eos = bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token"))
        self._chat_template, self._tool_template = _chat_template_of(cfg), _chat_template_of(cfg, "tool_use")
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        # Special: what tokenizer.json or tokenizer_config.json's added_tokens_decoder marks so (transformers adds
        # the config's special ones again as special; it never unmarks one), and every token with a role.
        marked = {int(i) for i, t in (cfg.get("added_tokens_decoder") or {}).items()
                  if isinstance(t, dict) and t.get("special")}
        self._special = {i for i, t in added.items() if t.special} | marked | {i for i in ids if i is not None}
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        self._byte_level = '"ByteLevel"' in json.dumps(decoder)
        self._lossy_bytes = isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"
        listed = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        codes = [t for t in map(_token_str, listed) if t and _LANGUAGE_TOKEN.fullmatch(t)]
        self._languages: dict[str, int] | None = {c: i for c in codes if (i := tokenizer.token_to_id(c)) is not None}
        self._languages = self._languages or None  # none listed: looked for as tags in the vocabulary when asked

    @classmethod
    def from_directory(cls, directory: str | Path) -> HFTokenizer:
        """Load tokenizer.json, or GPT-2's vocab.json + merges.txt, plus the optional config files."""
        d = Path(directory)
        config = _read_json(d / "tokenizer_config.json", {})
        if "added_tokens_decoder" not in config:  # an older save: its special_tokens_map.json names the roles
            config |= _read_json(d / "special_tokens_map.json", {})  # (and wins, as transformers reads it)
        if (d / "chat_template.jinja").is_file():  # it wins over the config's, as transformers reads them
            config["chat_template"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if (d / "tokenizer.json").is_file():
            return cls(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")), config)
        return cls(gpt2_tokenizer(d / "vocab.json", d / "merges.txt"), config)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (e.g. for training code that wants batch encoding)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self._explicit_flags:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        if add_special_tokens and self._add_eos and self._eos_id is not None:
            ids = [*ids, self._eos_id]
        return ids

    @property
    def language_codes(self) -> dict[str, int]:
        """A multilingual translator's language codes and their ids (NLLB's `eng_Latn`, M2M100's `__en__`):
        the special tokens tokenizer_config.json lists that name languages; else the vocabulary's target tags
        (MADLAD-400's `<2de>`, see `target_tagged`). Not to be changed by callers."""
        if self._languages is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._languages = {t: i for t, i in sorted(vocab.items(), key=lambda kv: kv[1])
                               if _LANGUAGE_TAG.fullmatch(t)}
        return self._languages

    @property
    def target_tagged(self) -> bool:
        """Whether the target language is a tag written in front of the source (`<2de> text`, MADLAD-400),
        rather than the decoder's forced first token (NLLB, M2M100)."""
        return any(code.startswith("<2") for code in self.language_codes)

    def encode_with_language(self, text: str, code: str) -> list[int]:
        """The source side of NLLB and M2M100 in `code`'s language: its code, the text's pieces, eos (NLLB's
        `legacy_behaviour`: the pieces, eos, the code). A tagged model (`target_tagged`): `code` is the target
        language's tag, in front of the text as its users write it."""
        if self.target_tagged:
            if code not in self.language_codes:
                raise ValueError(f"{code!r} is not one of this tokenizer's languages")
            return self.encode(f"{code} {text}")
        if code not in self.language_codes:
            raise ValueError(f"{code!r} is not one of this tokenizer's languages")
        pieces = self._tok.encode(text, add_special_tokens=False).ids
        if self._config.get("legacy_behaviour"):
            return [*pieces, self._eos_id, self._languages[code]]
        return [self._languages[code], *pieces, self._eos_id]

    def backend_json(self) -> str | None:
        return self._tok.to_str()

    @property
    def decodes_bytes_lossily(self) -> bool:
        return self._lossy_bytes

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = list(map(int, ids))
        if skip_special_tokens and not self._special.isdisjoint(ids):  # config-declared specials too
            ids = [i for i in ids if i not in self._special]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context: list[int], skip_special_tokens: bool = True) -> Callable[[int], str | None] | None:
        """tokenizers' DecodeStream (0.22 and later; older ones have none), in Rust: it keeps the same window of ids
        as `IncrementalDetokenizer` and decodes it with `decode`'s pipeline."""
        try:
            from tokenizers.decoders import DecodeStream

            if skip_special_tokens:  # what `decode` drops before the library sees it
                context = [i for i in context if i not in self._special]
            return partial(DecodeStream(ids=context, skip_special_tokens=skip_special_tokens).step, self._tok)
        except (ImportError, TypeError):
            return None

    def id_to_token(self, i: int) -> str:
        if i in self._added:
            return self._added[i]
        piece = self._tok.id_to_token(i)
        if piece is None:
            return ""
        if not self._byte_level:
            return piece.replace(SPIECE_UNDERLINE, " ")
        table = _byte_decoder()
        raw = b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        return raw.decode("utf-8", errors="tokenizer_hexbyte")

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        config = dict(self._config, **self._special_tokens)
        if self._explicit_flags:
            config.update(add_bos_token=self._add_bos, add_eos_token=self._add_eos)
        _write_json(d / "tokenizer_config.json", config)


def gpt2_tokenizer(vocab_file: str | Path, merges_file: str | Path) -> tokenizers.Tokenizer:
    """Build the ``tokenizers`` pipeline transformers' GPT2Tokenizer builds from vocab.json + merges.txt.

    Byte-level pre-tokenizer without prefix space and ``<|endoftext|>`` as a special added token
    (appended to the vocab if missing, as transformers does); no post-processor, so nothing is added.
    """
    bpe = models.BPE.from_file(
        str(vocab_file), str(merges_file), continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(GPT2_SPECIAL, special=True, normalized=False)])
    return tok


class MarianTokenizer(Tokenizer):
    """Helsinki-NLP opus-mt layout, reproducing ``transformers.MarianTokenizer`` ids and text.

    Source text goes through source.spm, target text through target.spm; both map pieces through
    vocab.json (pieces missing from it become ``<unk>``, since Marian's vocab ids are not the spm
    ids) and get ``</s>`` appended, never a BOS. A leading ``>>xx<<`` language code is kept as one
    token, and special-token strings inside the text become their ids, as in transformers.
    """

    def __init__(
        self,
        source_spm: bytes,
        target_spm: bytes,
        vocab: dict[str, int],
        *,
        target_vocab: dict[str, int] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self._config = dict(config or {})
        names = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
        names.update({k: _token_str(self._config[k]) for k in names if _token_str(self._config.get(k))})
        self._special_tokens = {"bos_token": None, **names}
        if names["unk_token"] not in vocab:
            raise ValueError(f"Marian vocab.json must contain the unk token {names['unk_token']!r}")
        self._spm_bytes = (source_spm, target_spm)
        self._src = sentencepiece.SentencePieceProcessor(model_proto=source_spm)
        self._tgt = sentencepiece.SentencePieceProcessor(model_proto=target_spm)
        self._vocab, self._target_vocab = vocab, target_vocab
        self._decoder = {i: p for p, i in (target_vocab or vocab).items()}
        extra = [t for t in map(_token_str, self._config.get("additional_special_tokens") or []) if t]
        self._special_strs = [t for t in [*names.values(), *extra] if t in vocab]
        self._eos_id, self._unk_id, self._pad_id = (
            vocab.get(names[k]) for k in ("eos_token", "unk_token", "pad_token")
        )
        self._special = {vocab[t] for t in self._special_strs}  # incl. <unk>: transformers skips it too
        ordered = sorted(self._special_strs, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        self._chat_template = _chat_template_of(self._config)
        self._tool_template = _chat_template_of(self._config, "tool_use")

    @classmethod
    def from_directory(cls, directory: str | Path) -> MarianTokenizer:
        """Load source.spm, target.spm, vocab.json and the optional tokenizer_config.json / target_vocab.json."""
        d = Path(directory)
        config = _read_json(d / "tokenizer_config.json", {})
        target_vocab = _read_json(d / "target_vocab.json") if config.get("separate_vocabs") else None
        spms = ((d / "source.spm").read_bytes(), (d / "target.spm").read_bytes())
        return cls(*spms, _read_json(d / "vocab.json"), target_vocab=target_vocab, config=config)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)  # what transformers reports; the target vocab may differ if separate

    def _encode(
        self, text: str, spm: sentencepiece.SentencePieceProcessor, vocab: dict[str, int], add: bool
    ) -> list[int]:
        ids: list[int] = []
        unk = vocab.get(str(self._special_tokens["unk_token"]), self._unk_id)
        for chunk in self._split_re.split(text) if self._split_re else [text]:
            if not chunk:
                continue
            if chunk in self._special_strs:
                ids.append(vocab.get(chunk, self._vocab[chunk]))
                continue
            code: list[str] = []
            if chunk.startswith(">>") and (end := chunk.find("<<")) != -1:
                code, chunk = [chunk[: end + 2]], chunk[end + 2 :]
            ids.extend(vocab.get(p, unk) for p in code + spm.encode(chunk, out_type=str))
        if add and self._eos_id is not None:
            ids.append(self._eos_id)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, self._src, self._vocab, add_special_tokens)

    def encode_target(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, self._tgt, self._target_vocab or self._vocab, add_special_tokens)

    def _piece(self, i: int) -> str:
        if i in self._decoder:
            return self._decoder[i]
        # transformers falls back to the target spm's own id space for ids missing from vocab.json
        ok = 0 <= i < self._tgt.get_piece_size()
        return self._tgt.id_to_piece(i) if ok else str(self._special_tokens["unk_token"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Target-side decode, as transformers' ``convert_tokens_to_string`` with ``use_source_tokenizer=False``."""
        pieces = [self._piece(int(i)) for i in ids if not (skip_special_tokens and int(i) in self._special)]
        out, run = "", []
        for piece in pieces:
            if piece in self._special_strs:  # special tokens must not go through sentencepiece
                out += self._tgt.decode_pieces(run) + piece + " "
                run = []
            else:
                run.append(piece)
        out += self._tgt.decode_pieces(run)
        return out.replace(SPIECE_UNDERLINE, " ").strip()

    def id_to_token(self, i: int) -> str:
        return self._piece(i).replace(SPIECE_UNDERLINE, " ")

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "source.spm").write_bytes(self._spm_bytes[0])
        (d / "target.spm").write_bytes(self._spm_bytes[1])
        _write_json(d / "vocab.json", self._vocab)
        if self._target_vocab is not None:
            _write_json(d / "target_vocab.json", self._target_vocab)
        config = dict(self._config, **{k: v for k, v in self._special_tokens.items() if v is not None})
        _write_json(d / "tokenizer_config.json", config)


# M2M100's language codes in the order their tokens follow vocab.json (fairseq's; transformers' M2M100Tokenizer).
M2M100_LANGUAGES = {
    "m2m100": ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi "
               "hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns "
               "oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh "
               "zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}


class M2M100Tokenizer(MarianTokenizer):
    """M2M100 (facebook/m2m100_418M layout: sentencepiece.bpe.model + vocab.json), reproducing
    ``transformers.M2M100Tokenizer``: pieces map through vocab.json, the language tokens (``__de__``) follow it
    in fairseq's order, and a source is its language's token, the pieces, ``</s>``."""

    def __init__(self, spm: bytes, vocab: dict[str, int], config: dict[str, Any] | None = None) -> None:
        config = dict(config or {})
        codes = M2M100_LANGUAGES.get(config.get("language_codes") or "m2m100")
        if codes is None:
            raise ValueError(f"unknown M2M100 language_codes {config.get('language_codes')!r}")
        size = len(vocab)
        self._languages = {f"__{c}__": size + i for i, c in enumerate(codes)}
        extra = [t for t in map(_token_str, config.get("additional_special_tokens") or []) if t]
        config["additional_special_tokens"] = list(dict.fromkeys([*extra, *self._languages]))
        super().__init__(spm, spm, {**vocab, **self._languages}, config=config)
        self._default_source = self._languages.get(f"__{config.get('src_lang') or 'en'}__")

    @classmethod
    def from_directory(cls, directory: str | Path) -> M2M100Tokenizer:
        d = Path(directory)
        config = {**_read_json(d / "special_tokens_map.json", {}), **_read_json(d / "tokenizer_config.json", {})}
        return cls((d / "sentencepiece.bpe.model").read_bytes(), _read_json(d / "vocab.json"), config)

    @property
    def language_codes(self) -> dict[str, int]:
        return self._languages

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._encode(text, self._src, self._vocab, add_special_tokens)
        return [self._default_source, *ids] if add_special_tokens and self._default_source is not None else ids

    def encode_with_language(self, text: str, code: str) -> list[int]:
        if code not in self._languages:
            raise ValueError(f"{code!r} is not one of this tokenizer's languages")
        return [self._languages[code], *self._encode(text, self._src, self._vocab, True)]


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Detect the tokenizer layout in ``directory`` and load it.

    tokenizer.json wins; otherwise source.spm + target.spm + vocab.json is Marian, sentencepiece.bpe.model +
    vocab.json is M2M100 and vocab.json + merges.txt is GPT-2 byte-level BPE.
    """
    d = Path(directory)
    if (d / "tokenizer.json").is_file():
        return HFTokenizer.from_directory(d)
    if all((d / f).is_file() for f in ("source.spm", "target.spm", "vocab.json")):
        return MarianTokenizer.from_directory(d)
    if all((d / f).is_file() for f in ("sentencepiece.bpe.model", "vocab.json")):
        return M2M100Tokenizer.from_directory(d)
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return HFTokenizer.from_directory(d)
    raise ValueError(
        f"no tokenizer found in {str(d)!r}: looked for tokenizer.json, or source.spm + target.spm + vocab.json "
        "(Marian), or vocab.json + merges.txt (GPT-2 byte-level BPE)"
    )
