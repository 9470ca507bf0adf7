"""Languages as users write them, mapped to a multilingual model's own codes, and back to LibreTranslate's."""

from __future__ import annotations

import pytest

from tserve.model.language_codes import model_code, short_code

NLLB = ["eng_Latn", "deu_Latn", "zho_Hans", "zho_Hant", "arb_Arab", "ace_Arab", "ace_Latn", "nob_Latn"]
M2M100 = ["__en__", "__de__", "__zh__", "__ar__", "__no__"]


@pytest.mark.parametrize(("asked", "nllb", "m2m100"), [
    ("de", "deu_Latn", "__de__"), ("deu", "deu_Latn", "__de__"), ("de-DE", "deu_Latn", "__de__"),
    ("DE_at", "deu_Latn", "__de__"), ("deu_Latn", "deu_Latn", "__de__"), ("__de__", None, "__de__"),
    ("zh", "zho_Hans", "__zh__"), ("zh-Hant", "zho_Hant", "__zh__"), ("zh-Hant-TW", "zho_Hant", "__zh__"),
    ("zt", "zho_Hant", "__zh__"), ("ar", "arb_Arab", "__ar__"), ("ace", "ace_Arab", None),
    ("nb", "nob_Latn", None), ("fr", None, None), ("x", None, None), ("en-", None, None),
])
def test_model_code(asked, nllb, m2m100):
    assert model_code(asked, NLLB) == nllb
    assert model_code(asked, M2M100) == m2m100


def test_short_codes_are_libretranslates():
    assert [short_code(c) for c in NLLB] == ["en", "de", "zh", "zt", "ar", "ace", "ace", "nb"]
    assert [short_code(c) for c in M2M100] == ["en", "de", "zh", "ar", "no"]
    for code in NLLB:  # and they lead back to a code of the model's
        assert model_code(short_code(code), NLLB) is not None
