"""Where the committed test fixtures lie, and a fixture copied into a test's directory
(`committed_fixtures` makes them again)."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"
PROVENANCE = "fixture.json"


class MissingFixture(FileNotFoundError):
    pass


def copy_fixture(name: str, d: Path) -> Path:
    """The committed fixture `name` copied into `d` (created), which the caller may then change."""
    src = FIXTURES_DIR / name
    if not (src / PROVENANCE).is_file():
        raise MissingFixture(f"the committed fixture {src} is missing; make it with "
                             f"`python -m tests.helpers.committed_fixtures {name}`")
    d.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != PROVENANCE:
            shutil.copy2(f, d / f.name)
    return d
