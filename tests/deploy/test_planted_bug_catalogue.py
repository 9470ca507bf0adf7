"""The planted-bug catalogue (`make planted-bugs`) stays runnable: each bug's text occurs exactly once in its
file and each guarding test exists, so that a refactor cannot silently retire a bug."""

from __future__ import annotations

import re

from tests.tools.planted_bugs import BUGS, ROOT


def test_every_planted_bug_still_applies_and_names_existing_tests():
    for bug in BUGS:
        assert (ROOT / bug.path).read_text().count(bug.old) == 1, bug.name
        for test in bug.tests:
            path, _, name = test.partition("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, re.M), (bug.name, test)
    assert len({b.name for b in BUGS}) == len(BUGS)
