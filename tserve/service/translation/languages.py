"""Languages: their English names, and which one a text is in.

Detection is py3langid's naive Bayes classifier over byte n-grams; its model ships inside the package (an
LZMA-compressed npz, read without pickle), so nothing is downloaded. Asked over the languages the served
translators read, it ranks only those: a short German sentence is not mistaken for Luxembourgish when only
English and German are served.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

NAMES = {
    "af": "Afrikaans", "am": "Amharic", "an": "Aragonese", "ar": "Arabic", "as": "Assamese", "az": "Azerbaijani",
    "ba": "Bashkir", "be": "Belarusian", "bg": "Bulgarian", "bn": "Bengali", "br": "Breton", "bs": "Bosnian",
    "ca": "Catalan", "cs": "Czech", "cy": "Welsh", "da": "Danish", "de": "German", "dz": "Dzongkha",
    "el": "Greek", "en": "English", "eo": "Esperanto", "es": "Spanish", "et": "Estonian", "eu": "Basque",
    "fa": "Persian", "fi": "Finnish", "fo": "Faroese", "fr": "French", "fy": "Western Frisian", "ga": "Irish",
    "gd": "Scottish Gaelic", "gl": "Galician", "gu": "Gujarati", "ha": "Hausa", "he": "Hebrew", "hi": "Hindi",
    "hr": "Croatian", "ht": "Haitian Creole", "hu": "Hungarian", "hy": "Armenian", "id": "Indonesian",
    "ig": "Igbo", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "jv": "Javanese", "ka": "Georgian",
    "kk": "Kazakh", "km": "Khmer", "kn": "Kannada", "ko": "Korean", "ku": "Kurdish", "ky": "Kyrgyz",
    "la": "Latin", "lb": "Luxembourgish", "lg": "Ganda", "ln": "Lingala", "lo": "Lao", "lt": "Lithuanian",
    "lv": "Latvian", "mg": "Malagasy", "mk": "Macedonian", "ml": "Malayalam", "mn": "Mongolian", "mr": "Marathi",
    "ms": "Malay", "mt": "Maltese", "my": "Burmese", "nb": "Norwegian Bokmål", "ne": "Nepali", "nl": "Dutch",
    "nn": "Norwegian Nynorsk", "no": "Norwegian", "oc": "Occitan", "om": "Oromo", "or": "Odia", "pa": "Punjabi",
    "pl": "Polish", "ps": "Pashto", "pt": "Portuguese", "qu": "Quechua", "ro": "Romanian", "ru": "Russian",
    "rw": "Kinyarwanda", "sa": "Sanskrit", "se": "Northern Sami", "si": "Sinhala", "sk": "Slovak",
    "sl": "Slovenian", "sn": "Shona", "so": "Somali", "sq": "Albanian", "sr": "Serbian", "st": "Southern Sotho",
    "sv": "Swedish", "sw": "Swahili", "ta": "Tamil", "te": "Telugu", "tg": "Tajik", "th": "Thai",
    "tk": "Turkmen", "tl": "Tagalog", "tr": "Turkish", "tt": "Tatar", "ug": "Uyghur", "uk": "Ukrainian",
    "ur": "Urdu", "uz": "Uzbek", "vi": "Vietnamese", "vo": "Volapük", "wa": "Walloon", "xh": "Xhosa",
    "yo": "Yoruba", "zh": "Chinese", "zu": "Zulu",
    "bo": "Tibetan", "fj": "Fijian", "gn": "Guarani", "ks": "Kashmiri", "li": "Limburgish", "mi": "Maori",
    "ny": "Chichewa", "sd": "Sindhi", "sg": "Sango", "sm": "Samoan", "ss": "Swati", "su": "Sundanese",
    "ti": "Tigrinya", "tn": "Tswana", "ts": "Tsonga", "wo": "Wolof", "yi": "Yiddish",
    "zt": "Chinese (traditional)",  # LibreTranslate's code and name for Traditional Chinese
}


def language_name(code: str) -> str:
    """The English name of an ISO 639 code (a regional variant, e.g. pt-BR, by its base language), else
    the code itself."""
    base = code.replace("_", "-").split("-")[0].lower()
    name = NAMES.get(base)
    if name is None:
        return code
    return name if base == code.lower() else f"{name} ({code})"


class LanguageDetector:
    """py3langid's identifier, loaded on first use (about half a second), and a copy of it restricted to each
    set of candidate languages asked for, made once: restricting slices the whole model (about 0.8 ms),
    forty times the cost of ranking a sentence. Ranking only reads an identifier, so calls run side by side."""

    def __init__(self) -> None:
        self._full = None  # every language the model knows
        self._restricted: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()

    def _identifier(self, candidates: Sequence[str] | None):  # noqa: ANN202 - py3langid's LanguageIdentifier
        with self._lock:
            if self._full is None:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier  # noqa: PLC0415 - half a second

                self._full = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
            wanted = tuple(sorted({c for c in candidates or () if c in self._full.nb_classes}))
            if not wanted:
                return self._full
            if wanted not in self._restricted:
                restricted = copy.copy(self._full)  # shares the full model; set_languages replaces, not edits
                restricted.set_languages(list(wanted))
                self._restricted[wanted] = restricted
            return self._restricted[wanted]

    def rank(self, text: str, candidates: Sequence[str] | None = None) -> list[tuple[str, float]]:
        """(language, confidence 0-100), best first, over `candidates` (codes the model does not know are
        left out; none known or None: every language the model knows)."""
        best: dict[str, float] = {}
        for code, p in self._identifier(candidates).rank(text):  # a few codes twice (two scripts): keep the better
            best[code] = max(best.get(code, 0.0), float(p))
        return sorted(((c, round(100 * p, 2)) for c, p in best.items()), key=lambda x: -x[1])
