"""The repository stays small enough to clone quickly and to travel whole to a GPU machine: the tracked tree
(bundled models and committed test fixtures included) is at most 55 MB."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 55_000_000


def test_the_tracked_tree_is_at_most_55_mb():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    sizes = {n.decode(): (ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= LIMIT_BYTES, f"tracked files take {total / 1e6:.1f} MB (limit 55 MB); largest: {largest}"
