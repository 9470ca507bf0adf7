"""One planted bug of `make planted-bugs` (`tests/tools/planted_bugs.py`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    path: str
    old: str  # must occur exactly once in `path`
    new: str
    tests: tuple[str, ...]  # each must fail with the bug planted
