"""Readable token strings (`Tokenizer.tokens`, what logprobs' `token`/`bytes` and attention labels show) on a
SentencePiece vocabulary, where the byte-level tests of tests/model/test_option_combinations_tokenizers.py do not
reach: added tokens whose text holds SentencePiece's own space marker `▁` (DeepSeek's `<｜end▁of▁sentence｜>`), and
pieces that stand for a run of spaces (`▁▁`, `▁▁▁▁`, as Llama 2's and Mistral's vocabularies have for indented
code). Each is held to transformers on the same files: `convert_ids_to_tokens` for the token's text (its markers
read as spaces), and the whole sequence's `decode` for the bytes the tokens put together."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFBackend

from tserve.model.tokenizer import SPIECE_UNDERLINE, load_tokenizer, token_bytes

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SENTENCEPIECE = FIXTURES / "hf-mistral"  # SentencePiece BPE with byte fallback, Metaspace "first"


def _hf(d: Path):  # noqa: ANN202
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(d))


def _directory(d: Path, tokenizer_json: str) -> Path:
    """The SentencePiece fixture's config files beside `tokenizer_json`."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SENTENCEPIECE / name, d)
    return d


@pytest.fixture(scope="module")
def with_added_tokens(tmp_path_factory) -> tuple[Path, list[int]]:
    backend = HFBackend.from_file(str(SENTENCEPIECE / "tokenizer.json"))
    backend.add_tokens([AddedToken("<|tool▁call|>", special=False, normalized=False)])
    backend.add_special_tokens([AddedToken("<｜end▁of▁sentence｜>", special=True, normalized=False)])
    d = _directory(tmp_path_factory.mktemp("spm-added") / "tok", backend.to_str())
    return d, [backend.token_to_id("<|tool▁call|>"), backend.token_to_id("<｜end▁of▁sentence｜>")]


@pytest.fixture(scope="module")
def with_space_runs(tmp_path_factory) -> Path:
    """The fixture's vocabulary with pieces for two and four spaces, merged before anything else."""
    tj = json.loads((SENTENCEPIECE / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, size = tj["model"]["vocab"], len(tj["model"]["vocab"])
    vocab |= {"▁▁": size, "▁▁▁▁": size + 1}
    tj["model"]["merges"] = [["▁", "▁"], ["▁▁", "▁▁"], *tj["model"]["merges"]]
    for added in tj["added_tokens"]:  # added tokens keep their ids; the new pieces must not take one
        assert added["id"] < size
    return _directory(tmp_path_factory.mktemp("spm-spaces") / "tok", json.dumps(tj, ensure_ascii=False))


def test_added_tokens_of_a_sentencepiece_vocabulary_keep_their_space_markers(with_added_tokens):
    """An added token is text of its own, not a SentencePiece piece: a `▁` inside it is part of its name, so it
    reads as itself (transformers' convert_ids_to_tokens), special or not. Only a vocabulary piece's `▁` is a
    space. The byte-level case is test_added_tokens_outside_the_byte_alphabet_read_as_their_own_text."""
    d, added = with_added_tokens
    ours, theirs = load_tokenizer(d), _hf(d)
    assert ours.tokens(added) == theirs.convert_ids_to_tokens(added) == ["<|tool▁call|>", "<｜end▁of▁sentence｜>"]
    text = "Hi <|tool▁call|> there<｜end▁of▁sentence｜>"
    ids = ours.encode(text)
    assert ids == theirs(text).input_ids and set(added) <= set(ids)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    # a vocabulary piece beside them still shows its marker as a space
    shown = dict(zip(ids, ours.tokens(ids), strict=True))
    assert any(t.startswith(" ") for i, t in shown.items() if i not in added)
    assert all(SPIECE_UNDERLINE not in t for i, t in shown.items() if i not in added)


@pytest.mark.parametrize("text", ["def f():\n    return  1", "a  b    c", "    indented", "x        y"])
def test_a_piece_for_a_run_of_spaces_shows_every_space_it_stands_for(with_space_runs, text):
    """A SentencePiece piece may stand for several spaces (`▁▁▁▁`, indentation): its readable text is one space
    per marker, not just the first, so that the tokens' bytes (logprobs' `bytes`) put together are the text
    transformers decodes the whole sequence to, and each piece's text is its convert_ids_to_tokens with every
    marker a space."""
    ours, theirs = load_tokenizer(with_space_runs), _hf(with_space_runs)
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs(text, add_special_tokens=False).input_ids
    runs = {ours.backend.token_to_id("▁▁"), ours.backend.token_to_id("▁▁▁▁")}
    assert runs & set(ids), ours.tokens(ids)  # the text is split into the run pieces
    shown = ours.tokens(ids)
    assert shown == [t.replace(SPIECE_UNDERLINE, " ") for t in theirs.convert_ids_to_tokens(ids)]
    joined = b"".join(token_bytes(t) for t in shown).decode("utf-8")
    # (SentencePiece's decoder drops the space it put in front of the text, and only that one)
    assert joined.removeprefix(" ") == theirs.decode(ids) == ours.decode(ids)
    assert text.startswith(" ") or ours.decode(ids) == text
