"""Languages as users write them (ISO 639-1 `de`, ISO 639-3 `deu`, BCP-47 `de-DE`, `zh-Hant`) mapped to a
multilingual translator's own codes: NLLB-200's `deu_Latn` (ISO 639-3 and an ISO 15924 script), M2M100's
`__de__` (ISO 639-1) and MADLAD-400's tags `<2de>`, `<2zh_Latn>` (ISO 639-1 or -3, an optional script)."""

from __future__ import annotations

import re

# ISO 639-1 -> the ISO 639-3 code NLLB-200 uses (for a macrolanguage, the variety it was trained on: Arabic is
# Modern Standard Arabic `arb`, Persian `pes`, Malay `zsm`, Swahili `swh`, Norwegian Bokmål `nob`, ...).
ISO_639_3 = {
    "af": "afr", "am": "amh", "ar": "arb", "as": "asm", "az": "azj", "ba": "bak", "be": "bel", "bg": "bul",
    "bn": "ben", "bo": "bod", "bs": "bos", "ca": "cat", "cs": "ces", "cy": "cym", "da": "dan", "de": "deu",
    "dz": "dzo", "el": "ell", "en": "eng", "eo": "epo", "es": "spa", "et": "est", "eu": "eus", "fa": "pes",
    "fi": "fin", "fj": "fij", "fo": "fao", "fr": "fra", "ga": "gle", "gd": "gla", "gl": "glg", "gn": "grn",
    "gu": "guj", "ha": "hau", "he": "heb", "hi": "hin", "hr": "hrv", "ht": "hat", "hu": "hun", "hy": "hye",
    "id": "ind", "ig": "ibo", "is": "isl", "it": "ita", "ja": "jpn", "jv": "jav", "ka": "kat", "kk": "kaz",
    "km": "khm", "kn": "kan", "ko": "kor", "ks": "kas", "ky": "kir", "lb": "ltz", "lg": "lug", "li": "lim",
    "ln": "lin", "lo": "lao", "lt": "lit", "lv": "lvs", "mg": "plt", "mi": "mri", "mk": "mkd", "ml": "mal",
    "mn": "khk", "mr": "mar", "ms": "zsm", "mt": "mlt", "my": "mya", "nb": "nob", "ne": "npi", "nl": "nld",
    "nn": "nno", "no": "nob", "ny": "nya", "oc": "oci", "om": "gaz", "or": "ory", "pa": "pan", "pl": "pol",
    "ps": "pbt", "pt": "por", "qu": "quy", "ro": "ron", "ru": "rus", "rw": "kin", "sa": "san", "sd": "snd",
    "sg": "sag", "si": "sin", "sk": "slk", "sl": "slv", "sm": "smo", "sn": "sna", "so": "som", "sq": "als",
    "sr": "srp", "ss": "ssw", "st": "sot", "su": "sun", "sv": "swe", "sw": "swh", "ta": "tam", "te": "tel",
    "tg": "tgk", "th": "tha", "ti": "tir", "tk": "tuk", "tl": "tgl", "tn": "tsn", "tr": "tur", "ts": "tso",
    "tt": "tat", "ug": "uig", "uk": "ukr", "ur": "urd", "uz": "uzn", "vi": "vie", "wo": "wol", "xh": "xho",
    "yi": "ydd", "yo": "yor", "zh": "zho", "zu": "zul",
}
_ISO_639_1 = {three: one for one, three in ISO_639_3.items()} | {"nob": "nb"}
_ALIASES = {"zt": "zh-Hant"}  # LibreTranslate's code for Traditional Chinese
_TAG = re.compile(r"(?P<language>[A-Za-z]{2,3})(?:[-_](?P<script>[A-Za-z]{4}))?(?:[-_](?P<region>[A-Za-z]{2}|\d{3}))?"
                  r"(?:[-_][A-Za-z0-9]{2,8})*")
# A Chinese tag's region without a script says which script (CLDR's likely subtags): Traditional in these.
_TRADITIONAL_CHINESE_REGIONS = frozenset({"TW", "HK", "MO"})


def _bare(code: str) -> str:
    """A model code without its wrapping: `__de__` and `<2de>` -> `de`; `deu_Latn` stays; LibreTranslate's short
    code `zt` is `zh_Hant`, so that a script subtag finds it among the short codes routes are listed by."""
    if code.startswith("<2") and code.endswith(">"):
        return code[2:-1]
    if code == "zt":
        return "zh_Hant"
    return code.strip("_")


def model_code(requested: str, codes: list[str] | dict[str, int]) -> str | None:
    """The model's code for `requested` (one of its own codes, or ISO 639-1 / 639-3 / BCP-47), or None when
    the model has no such language. Where a language has several scripts, a script subtag picks one
    (`zh-Hant`); without one, the first of the model's codes wins (NLLB lists `zho_Hans` before `zho_Hant`)."""
    if requested in codes:
        return requested
    m = _TAG.fullmatch(_ALIASES.get(requested.strip(), requested.strip()))
    if m is None:
        return None
    language, script = m["language"].lower(), (m["script"] or "").title()
    if not script and language in ("zh", "zho") and (m["region"] or "").upper() in _TRADITIONAL_CHINESE_REGIONS:
        script = "Hant"
    three = ISO_639_3.get(language, language)
    one = _ISO_639_1.get(three, language if len(language) == 2 else None)
    candidates = [c for c in codes if _bare(c).split("_")[0] == language] or \
                 [c for c in codes if _bare(c).split("_")[0] == three] or \
                 [c for c in codes if one and _bare(c).split("_")[0] == one]
    if script:
        candidates = [c for c in candidates if _bare(c).endswith(f"_{script}")] or \
                     [c for c in candidates if "_" not in _bare(c)]
    return candidates[0] if candidates else None


def short_code(code: str) -> str:
    """The code LibreTranslate's clients use for a model's language code: ISO 639-1 where the language has
    one (`deu_Latn` -> `de`, `__de__` -> `de`), else ISO 639-3; Traditional Chinese is LibreTranslate's `zt`."""
    language, _, script = _bare(code).partition("_")
    if language == "zho" and script == "Hant":
        return "zt"
    return _ISO_639_1.get(language, language)
