"""`python -m tserve.training align` on imported multilingual translators (NLLB-200, MADLAD-400-shaped T5): the pairs are
encoded in the languages asked for (the source code first / the target's tag in front), the choice is written
into the checkpoint's generation_config.json (where Whisper's checkpoints keep theirs) and read back on load,
so that HTML tag placement uses it."""

from __future__ import annotations

import json

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import LEXICON
from tserve.model.alignment import KnownAlignment, default_heads
from tserve.model.checkpoint import load
from tserve.training import alignment
from tserve.training.data.pairs import TranslationPair

pytest.importorskip("transformers")

# Each pair keeps one capitalised word as it is on both sides (here: "Welt", a word both vocabularies hold).
WORDS = list(LEXICON)


def _pairs(offset: int) -> list[TranslationPair]:
    out = []
    for i in range(12):
        english = [WORDS[(offset + i + k) % len(WORDS)] for k in range(3)]
        german = [LEXICON[w] for w in english]
        out.append(TranslationPair(" ".join([*english, "Welt"]), " ".join([*german, "Welt"]), "ding"))
    return out


@pytest.mark.parametrize("family", ["nllb", "t5"])
def test_heads_chosen_on_an_imported_translator_are_written_and_read_back(family, tmp_path, monkeypatch):
    d = (factories.hf_nllb_dir if family == "nllb" else factories.hf_t5_dir)(tmp_path / family)
    seen: list[KnownAlignment] = []
    real = alignment.copy_alignments
    monkeypatch.setattr(alignment, "copy_alignments",
                        lambda *a, **k: seen.extend(found := real(*a, **k)) or found)
    report = alignment.choose(d, splits={"valid": _pairs(0), "test": _pairs(5)}, source="en", target="de")
    loaded = load(d)
    tok = loaded.tokenizer
    first = seen[0]
    if family == "nllb":  # the source in English (its code first), the target behind German's code
        assert first.source_ids[0] == tok.language_codes["eng_Latn"]
        assert first.target_ids[0] == tok.language_codes["deu_Latn"]
    else:  # German's tag in front of the source
        assert first.source_ids[0] == tok.language_codes["<2de>"]
    assert report["valid_pairs"] >= 8 and report["test_gold_tokens"] > 0  # (a pair holding "world" twice is not)
    written = json.loads((d / "generation_config.json").read_text())
    assert written["alignment_heads"] == report["heads"] and not (d / "generation.json").exists()
    heads, offset = default_heads(loaded)
    assert [list(h) for h in heads] == report["heads"] and offset == report["offset"]


@pytest.mark.parametrize("family", ["marian", "nllb", "t5"])
def test_alignment_heads_and_offset_in_generation_config_are_read(family, tmp_path):
    """What `align` writes, as another run (or Whisper-style checkpoints) leaves it: both the heads and the offset
    (which decoder position stands for a target token) are what tag placement reads; without them, the last
    decoder layer's heads at offset 0."""
    d = {"marian": factories.hf_marian_dir, "nllb": factories.hf_nllb_dir, "t5": factories.hf_t5_dir}[family](
        tmp_path / family)
    last = load(d).config.n_decoder_layers - 1
    assert default_heads(load(d))[1] == 0 and {h[0] for h in default_heads(load(d))[0]} == {last}
    path = d / "generation_config.json"
    written = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(written | {"alignment_heads": [[0, 1], [last, 2]], "alignment_offset": 1}))
    assert default_heads(load(d)) == ([(0, 1), (last, 2)], 1)
