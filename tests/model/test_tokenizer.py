"""Tests for model.tokenizer: tiny tokenizers trained in-test, checked against transformers."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

from tserve.model.detokenizer import IncrementalDetokenizer
from tserve.model.tokenizer import (
    HFTokenizer,
    MarianTokenizer,
    Tokenizer,
    load_tokenizer,
)
from tserve.testing.checkpoints import marian_vocab

EN = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a small test corpus for tokenizers.",
    "I love pizza 🍕 and coffee ☕ very much!",
    "We are testing emoji 😀 and umlauts in a sentence.",
    "The weather is nice today, isn't it?",
]
DE = [
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Über allen Gipfeln ist Ruh. Straße, Mädchen, schön, größer.",
    "Ich liebe Pizza 🍕 und Kaffee ☕ sehr!",
    "Wir testen Emoji 😀 und Umlaute ä ö ü ß.",
    "Das Wetter ist heute schön, nicht wahr?",
]
SAMPLES = [
    "Hello world",
    " leading space and  double  spaces ",
    "Über Mädchen größer Straße",
    "pizza 🍕 and 😀😀 emoji",
    "line one\nline two\ttab",
    "unseen: Zebra 🦓 日本語 ñ",
    "",
]
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _train_bpe(special: list[str]) -> HFBackend:
    tok = HFBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((EN + DE) * 3, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our own checkpoint layout: tokenizer.json + tokenizer_config.json with flags and a template."""
    d = tmp_path_factory.mktemp("bpe")
    _train_bpe(["<s>", "</s>", "<pad>", "<unk>"]).save(str(d / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module", params=["with_eot", "without_eot"])
def gpt2_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-2 layout; without <|endoftext|> in vocab.json transformers appends it as a new id."""
    return _make_gpt2_dir(tmp_path_factory, with_eot=request.param == "with_eot")


def _make_gpt2_dir(tmp_path_factory: pytest.TempPathFactory, with_eot: bool) -> Path:
    d = tmp_path_factory.mktemp("gpt2")
    _train_bpe(["<|endoftext|>"] if with_eot else []).model.save(str(d))
    assert (d / "vocab.json").is_file() and (d / "merges.txt").is_file()
    return d


def _train_spm(path: Path, lines: list[str], **kw: object) -> bytes:
    (path.parent / f"{path.name}.txt").write_text("\n".join(lines * 3), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(path.parent / f"{path.name}.txt"),
        model_prefix=str(path),
        hard_vocab_limit=False,
        unk_id=0,  # opus-mt spm models: <unk>=0, </s>=1 (vocab.json renumbers everything anyway)
        eos_id=1,
        bos_id=-1,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
        **kw,
    )
    return Path(f"{path}.model").read_bytes()


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """opus-mt layout: unigram source model, byte-fallback BPE target model, one shared vocab.json."""
    d = tmp_path_factory.mktemp("marian")
    src = _train_spm(d / "src", EN + DE[:1], model_type="unigram", character_coverage=1.0, vocab_size=100)
    tgt = _train_spm(
        d / "tgt", DE, model_type="bpe", character_coverage=0.98, byte_fallback=True, vocab_size=330
    )
    (d / "source.spm").write_bytes(src)
    (d / "target.spm").write_bytes(tgt)
    vocab = marian_vocab(src, tgt, extra=(">>de<<",))
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    config = {
        "source_lang": "en",
        "target_lang": "de",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def _hf_marian(d: Path):  # noqa: ANN202
    HFMarian = pytest.importorskip("transformers").MarianTokenizer  # noqa: N806

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses."
        return HFMarian.from_pretrained(str(d))


# --- HF tokenizers -------------------------------------------------------------------------------


def test_bpe_roundtrip_and_flags(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir)
    backend = HFBackend.from_file(str(bpe_dir / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.special_ids == {0, 1, 2, 3}
    assert tok.vocab_size == backend.get_vocab_size()
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == [tok.bos_id, *backend.encode(text).ids]  # add_bos_token=True, add_eos_token=False
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.encode_target(text) == ids
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_add_eos_flag_and_save_roundtrip(bpe_dir: Path, tmp_path: Path) -> None:
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(src)
    ids = tok.encode("Hallo Welt")
    assert ids[-1] == tok.eos_id and ids[0] != tok.bos_id
    assert tok.decode(ids) == "Hallo Welt"
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.encode("Hallo Welt") == ids
    assert again.chat_template == TEMPLATE
    assert (again.bos_id, again.eos_id, again.pad_id, again.unk_id) == (
        tok.bos_id,
        tok.eos_id,
        tok.pad_id,
        tok.unk_id,
    )


def test_config_declared_specials_are_skipped(bpe_dir: Path, tmp_path: Path) -> None:
    backend = HFBackend.from_file(str(bpe_dir / "tokenizer.json"))
    backend.add_tokens(["<start>"])  # a plain added token, not flagged special in tokenizer.json
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<start>", "add_bos_token": True})
    )
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("Hallo")
    assert ids[0] == tok.bos_id == backend.token_to_id("<start>") and tok.bos_id in tok.special_ids
    assert tok.decode(ids) == "Hallo"


def test_gpt2_layout_matches_transformers(gpt2_dir: Path) -> None:
    GPT2TokenizerFast = pytest.importorskip("transformers").GPT2TokenizerFast  # noqa: N806
    hf = GPT2TokenizerFast(str(gpt2_dir / "vocab.json"), str(gpt2_dir / "merges.txt"))
    tok = load_tokenizer(gpt2_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_id == tok.eos_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.pad_id is None and tok.vocab_size == len(hf)
    for text in [*SAMPLES, "end<|endoftext|>start", " Hello Hello  hello"]:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert tok.decode(tok.encode("a<|endoftext|>b")) == "ab"


def test_byte_level_tokens_are_readable(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir)
    text = " hello schön 😀"
    ids = tok.encode(text, add_special_tokens=False)
    raw = [tok.backend.id_to_token(i) for i in ids]
    assert any(r.startswith("Ġ") for r in raw)  # the byte-level alphabet needs converting back
    pieces = tok.tokens(ids)
    assert "".join(pieces) == text and " schön" in pieces
    split = tok.tokens(tok.encode("a😀", add_special_tokens=False))
    assert (
        split[0] == "a" and len(split) > 2 and split[1].startswith("<0xF0>")
    )  # partial char shows its bytes
    assert tok.id_to_token(tok.bos_id) == "<s>"


# --- Marian --------------------------------------------------------------------------------------

MARIAN_SAMPLES = [
    "Hello world, this is a test.",
    "Ich liebe Pizza 🍕 und größere Mädchen!",
    "  extra   spaces  ",
    "Zebra 🦓 xylophon ñ",
    ">>de<< Hello world",
    "Hello </s> world <unk> x <pad>",
    "",
]


def test_marian_matches_transformers(marian_dir: Path) -> None:
    hf = _hf_marian(marian_dir)
    tok = load_tokenizer(marian_dir)
    assert isinstance(tok, MarianTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (None, 0, 1, tok.vocab_size - 1)
    assert tok.vocab_size == hf.vocab_size
    assert tok.special_ids == set(hf.all_special_ids)
    for text in MARIAN_SAMPLES:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        target = hf(text_target=text)["input_ids"]
        assert tok.encode_target(text) == target, text
        for skip in (True, False):
            expected = hf.decode(target, skip_special_tokens=skip, use_source_tokenizer=False)
            assert tok.decode(target, skip_special_tokens=skip) == expected, (text, skip)
    assert tok.encode("Hello world")[-1] == tok.eos_id
    assert tok.encode(">>de<< Hi")[0] == json.loads((marian_dir / "vocab.json").read_text())[">>de<<"]


def test_marian_decodes_with_target_spm(marian_dir: Path) -> None:
    tok = load_tokenizer(marian_dir)
    ids = tok.encode_target("Zebra 🦓 im Zoo")
    assert any(p.startswith("<0x") for p in tok.tokens(ids))  # the zebra is only byte-fallback pieces
    assert tok.decode(ids) == "Zebra 🦓 im Zoo"
    assert tok.encode("Zebra 🦓") != tok.encode_target("Zebra 🦓")
    assert "".join(tok.tokens(tok.encode_target("Hallo Welt", add_special_tokens=False))) == " Hallo Welt"


def test_marian_with_separate_vocabularies_matches_transformers(marian_dir: Path, tmp_path: Path) -> None:
    """`separate_vocabs` (opus-mt-tc models): the target side's ids come from target_vocab.json, its own order,
    for encoding targets and decoding; the source side keeps vocab.json."""
    import random
    import shutil

    d = Path(shutil.copytree(marian_dir, tmp_path / "separate"))
    vocab = json.loads((d / "vocab.json").read_text())
    fixed = {"</s>", "<unk>", "<pad>"}
    pieces = [p for p in vocab if p not in fixed]
    ids = [vocab[p] for p in pieces]
    random.Random(0).shuffle(ids)
    (d / "target_vocab.json").write_text(json.dumps({p: vocab[p] for p in fixed} | dict(zip(pieces, ids, strict=True)),
                                                    ensure_ascii=False), encoding="utf-8")
    config = json.loads((d / "tokenizer_config.json").read_text()) | {"separate_vocabs": True}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    hf, tok, shared = _hf_marian(d), load_tokenizer(d), load_tokenizer(marian_dir)
    for text in MARIAN_SAMPLES:
        assert tok.encode(text) == hf(text)["input_ids"] == shared.encode(text), text
        target = hf(text_target=text)["input_ids"]
        assert tok.encode_target(text) == target, text
        assert tok.decode(target) == hf.decode(target, skip_special_tokens=True) == shared.decode(shared.encode_target(text))
    assert any(tok.encode_target(t) != shared.encode_target(t) for t in MARIAN_SAMPLES)


def test_marian_save_roundtrip(marian_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(marian_dir)
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, MarianTokenizer)
    for text in MARIAN_SAMPLES:
        assert again.encode(text) == tok.encode(text)
        assert again.decode(tok.encode_target(text)) == tok.decode(tok.encode_target(text))


# --- incremental detokenization ------------------------------------------------------------------


@pytest.fixture(params=["bpe", "gpt2", "marian"])
def any_tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "gpt2":
        return load_tokenizer(_make_gpt2_dir(tmp_path_factory, with_eot=True))
    return load_tokenizer(request.getfixturevalue(f"{request.param}_dir"))


STREAM_TEXT = "Über 😀 Mädchen 🍕🦓 größer, schön ja!"


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pushes = [detok.push(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(pushes) + tail
    return pushes, tail


def test_incremental_every_prefix_equals_decode(any_tok: Tokenizer) -> None:
    ids = any_tok.encode_target(STREAM_TEXT)
    assert any("\ufffd" in any_tok.decode([i]) for i in ids), "test text must split a character over tokens"
    for k in range(len(ids) + 1):
        pushes, tail = _stream(any_tok, ids[:k])
        assert "".join(pushes) + tail == any_tok.decode(ids[:k]), k
    pushes, tail = _stream(any_tok, ids)
    assert "".join(pushes) + tail == STREAM_TEXT
    assert not any("\ufffd" in p for p in pushes)
    assert "" in pushes  # something was held back mid-way


def test_incremental_holds_back_partial_character(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir)
    ids = tok.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids] == ["a"] + [""] * (len(ids) - 2) + ["😀"]
    assert detok.flush() == ""
    broken = IncrementalDetokenizer(tok)  # a stream cut mid-character still surfaces at flush
    assert [broken.push(i) for i in ids[:-1]] == ["a"] + [""] * (len(ids) - 2)
    assert broken.flush() == tok.decode(ids[:-1])[1:]


def _byte_ids(d: Path) -> dict[int, int]:
    return _byte_ids_of(load_tokenizer(d))


def _byte_ids_of(tok: Tokenizer) -> dict[int, int]:
    """byte -> id of the single-byte tokens of a byte-level tokenizer's vocabulary."""
    from tserve.model.tokenizer import _byte_decoder

    table = _byte_decoder()
    return {table[t]: i for t, i in tok._tok.get_vocab().items() if len(t) == 1 and t in table}  # type: ignore[attr-defined]


class _CountingTokenizer:
    """A tokenizer that counts the ids it decodes (how much work a stream costs)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.decoded = tok, 0
        self.decodes_bytes_lossily = tok.decodes_bytes_lossily

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


def test_byte_level_streams_hold_back_only_a_character_that_can_still_finish(bpe_dir: Path) -> None:
    """Random mixes of words, whole characters split over byte tokens, and broken bytes (lone continuation
    bytes, lead bytes never finished): at every prefix the pushes plus flush are the decode, and what is held
    back is at most the last U+FFFD."""
    import random

    tok, byte = load_tokenizer(bpe_dir), _byte_ids(bpe_dir)
    assert tok.decodes_bytes_lossily
    words = tok.encode(" Hello world schön", add_special_tokens=False)
    pieces = [[byte[b] for b in "😀".encode()], [byte[b] for b in "ä".encode()], [byte[0x80]], [byte[0xE2]],
              [byte[0xF0], byte[0x9F]], [byte[0xC3]], *[[w] for w in words]]
    rng = random.Random(0)
    for _ in range(40):
        ids = [i for _ in range(rng.randint(1, 12)) for i in rng.choice(pieces)]
        detok = IncrementalDetokenizer(tok)
        for k, i in enumerate(ids, 1):
            detok.push(i)
            held = tok.decode(ids[:k])[len(detok.text):]
            assert tok.decode(ids[:k]).startswith(detok.text) and held in ("", "\ufffd"), (ids[:k], held)
        assert detok.text + detok.flush() == tok.decode(ids)


def test_bytes_that_never_form_utf8_still_stream_at_a_bounded_cost(bpe_dir: Path) -> None:
    tok, byte = load_tokenizer(bpe_dir), _byte_ids(bpe_dir)
    for loop in ([byte[0xE2]], [byte[0x80]], [byte[0xE2], byte[0x82]]):  # lead bytes, continuation bytes
        ids = loop * (300 // len(loop))
        counting = _CountingTokenizer(tok)
        detok = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
        pushes = [detok.push(i) for i in ids]
        assert "".join(pushes) + detok.flush() == tok.decode(ids)
        assert sum(p != "" for p in pushes) >= len(ids) // len(loop) - 2, loop  # a chunk every broken sequence
        assert counting.decoded < 40 * len(ids), "the held window must not grow with the stream"


def test_sentencepiece_byte_fallback_holds_back_the_whole_broken_run(marian_dir: Path) -> None:
    """Byte fallback turns a run of byte pieces that is not UTF-8 as a whole into a U+FFFD a byte, and a later
    byte can mend the whole run: nothing of it is sent until then."""
    tok = load_tokenizer(marian_dir)
    assert not tok.decodes_bytes_lossily
    ids = tok.encode_target(STREAM_TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    pushes = [detok.push(i) for i in ids]
    assert not any("\ufffd" in p for p in pushes) and "".join(pushes) + detok.flush() == tok.decode(ids)


def test_incremental_with_prompt_keeps_leading_space(marian_dir: Path) -> None:
    tok = load_tokenizer(marian_dir)
    prompt = tok.encode_target("Ich liebe", add_special_tokens=False)
    gen = tok.encode_target("Pizza 🍕 sehr", add_special_tokens=False) + [tok.eos_id]
    pushes, tail = _stream(tok, gen, prompt)
    assert "".join(pushes) + tail == " Pizza 🍕 sehr"
    full = tok.decode(prompt + gen)
    assert full == tok.decode(prompt) + "".join(pushes) + tail


# --- loading errors and chat templates ------------------------------------------------------------


class _Decodes:
    """A tokenizer wrapper that counts what `decode` is asked for and may take away the library's stream."""

    def __init__(self, tok: Tokenizer, stream: bool) -> None:
        self.tok, self.decoded = tok, 0
        self.decodes_bytes_lossily, self.special_ids = tok.decodes_bytes_lossily, tok.special_ids
        if stream:
            self.decode_stream = tok.decode_stream

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(params=["bpe-config-specials", "gpt2", "hf-llama", "hf-gemma3", "hf-mistral", "hf-nllb", "hf-t5"])
def stream_tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, bpe_dir: Path) -> Tokenizer:
    if request.param == "gpt2":
        return load_tokenizer(_make_gpt2_dir(tmp_path_factory, with_eot=True))
    if request.param == "bpe-config-specials":  # a special that only tokenizer_config.json names
        d = tmp_path_factory.mktemp("config-specials")
        backend = HFBackend.from_file(str(bpe_dir / "tokenizer.json"))
        backend.add_tokens(["<start>"])
        backend.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<start>", "add_bos_token": True}))
        return load_tokenizer(d)
    return load_tokenizer(FIXTURES / request.param)


def test_the_libraries_stream_sends_what_the_window_decodes_send(stream_tok: Tokenizer) -> None:
    """tokenizers' DecodeStream stands in for the two decodes a token: on streams of text, broken bytes,
    specials and random ids, after a prompt or none, skipping specials or not, every push and the flush are the
    same with it as without it, and on plain text it leaves `decode` nothing to do."""
    import random

    tok = stream_tok
    assert tok.decode_stream([]) is not None, "this tokenizer's library has a stream"
    vocab = len(tok._tok.get_vocab())  # type: ignore[attr-defined]
    texts = [*EN, *DE, *SAMPLES]
    specials = sorted(tok.special_ids)
    rng = random.Random(0)
    for trial in range(60):
        ids: list[int] = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.6:
                ids += tok.encode(rng.choice(texts), add_special_tokens=False)
            elif kind < 0.8 and specials:
                ids.append(rng.choice(specials))
            else:
                ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        prompt = tok.encode(rng.choice(texts)) if trial % 2 else None
        skip = trial % 3 != 2
        with_stream, without = _Decodes(tok, stream=True), _Decodes(tok, stream=False)
        streamed = IncrementalDetokenizer(with_stream, prompt, skip)  # type: ignore[arg-type]
        decoded = IncrementalDetokenizer(without, prompt, skip)  # type: ignore[arg-type]
        for k, i in enumerate(ids):
            assert streamed.push(i) == decoded.push(i), (trial, k, ids[: k + 1], prompt, skip)
        assert streamed.flush() == decoded.flush() and streamed.text == decoded.text, (trial, ids)
    text = tok.encode(" ".join(EN[:2]), add_special_tokens=False)
    if tok.decodes_bytes_lossily:  # first a broken byte the decodes send and the library holds: it starts again
        byte = _byte_ids_of(tok)
        text = [byte[0xE2], *[byte[b] for b in "—".encode()], *text]
    for counting in (with_stream := _Decodes(tok, stream=True), without := _Decodes(tok, stream=False)):
        detok = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
        assert "".join(detok.push(i) for i in text) + detok.flush() == tok.decode(text)
    assert with_stream.decoded < without.decoded / 4, "plain text was decoded here, not by the stream"


def test_load_tokenizer_empty_dir_names_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    for name in (str(tmp_path), "tokenizer.json", "source.spm", "target.spm", "vocab.json", "merges.txt"):
        assert name in message


def test_chat_template(bpe_dir: Path, gpt2_dir: Path, marian_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hallo"}]
    assert tok.apply_chat_template(messages) == "<|user|>Hi</s>\n<|assistant|>Hallo</s>\n<|assistant|>"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hallo</s>\n")
    with pytest.raises(ValueError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    for other in (gpt2_dir, marian_dir):
        plain = load_tokenizer(other)
        assert plain.chat_template is None
        with pytest.raises(ValueError, match="no chat template"):
            plain.apply_chat_template(messages)


# --- where a checkpoint's tokenizer files disagree ---------------------------------------------------------
# Real checkpoints carry the special tokens in up to three files that do not always agree: tokenizer.json's
# added tokens (each flagged special or not), tokenizer_config.json (roles, and its own added_tokens_decoder
# flags) and an older special_tokens_map.json. Each case is held to what transformers makes of the same files.
DISAGREEING_TEXT = "hi <|im_start|>user <tool_call> x <extra> y<|im_end|> z<|endoftext|>"


def _flag(token: str, special: bool) -> dict:
    return {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


@pytest.fixture(scope="module")
def chat_backend() -> HFBackend:
    from tokenizers import AddedToken  # noqa: PLC0415

    tok = _train_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("<extra>", special=False, normalized=False)])
    return tok


DISAGREEMENTS = {
    # an older save (no added_tokens_decoder): special_tokens_map.json's roles win over tokenizer_config.json's
    "older-save-map-names-another-eos": ({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                                         {"eos_token": "<|endoftext|>", "pad_token": "<|im_start|>"}),
    # a newer save: special_tokens_map.json is not read at all
    "newer-save-ignores-the-map": ({"eos_token": "<|im_end|>", "added_tokens_decoder": {}},
                                   {"eos_token": "<|endoftext|>", "pad_token": "<|im_start|>"}),
    # the config marks special a token tokenizer.json does not: decoding leaves it out
    "config-marks-a-token-special": ({"eos_token": "<|im_end|>",
                                      "added_tokens_decoder": {"tool_call": _flag("<tool_call>", True)}}, None),
    # the config unmarks one tokenizer.json marks: still special
    "config-unmarks-a-special-token": ({"eos_token": "<|im_end|>",
                                        "added_tokens_decoder": {"im_start": _flag("<|im_start|>", False)}}, None),
    "additional-special-tokens": ({"eos_token": "<|im_end|>", "additional_special_tokens": ["<extra>"]}, None),
}


@pytest.mark.parametrize("case", DISAGREEMENTS)
def test_disagreeing_tokenizer_files_read_as_transformers_reads_them(case, chat_backend, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config, special_map = DISAGREEMENTS[case]
    vocab = chat_backend.get_vocab(with_added_tokens=True)
    if "added_tokens_decoder" in config:  # keyed by id in the file
        config = config | {"added_tokens_decoder": {str(vocab[t["content"]]): t
                                                    for t in config["added_tokens_decoder"].values()}}
    chat_backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))
    ours = load_tokenizer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = theirs.encode(DISAGREEING_TEXT)
    assert ours.encode(DISAGREEING_TEXT) == ids
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
