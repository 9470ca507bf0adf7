"""A benchmark's working directory: the one its `--work` names, kept for the next run (converted checkpoints, GGUF
files, server logs), or else a new temporary one, removed when the script exits (a roofline run writes ~1 GB of
checkpoints; a directory left behind by every run fills a disk)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(given: str | Path | None, prefix: str) -> Path:
    """`given` (made if missing, kept), or a new temporary directory named `prefix...` removed at exit."""
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
