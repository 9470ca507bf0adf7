"""The planted-bug catalogue (`make planted-bugs`) stays runnable: each bug's text occurs exactly once in its
file and each guarding test exists, so that a refactor cannot silently retire a bug."""

from __future__ import annotations

import re

from tests.tools.planted_bugs import BUGS, KERNEL_CODE, ROOT, selected


def test_every_planted_bug_still_applies_and_names_existing_tests():
    for bug in BUGS:
        assert (ROOT / bug.path).read_text().count(bug.old) == 1, bug.name
        for test in bug.tests:
            path, _, name = test.partition("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, re.M), (bug.name, test)
    assert len({b.name for b in BUGS}) == len(BUGS)


def test_make_test_catches_every_planted_bug_and_make_test_avx2_every_bug_in_the_kernels():
    """`make test` leaves the tests marked slow out: each bug keeps a test there. A bug in the kernels' code keeps
    one that `make test-avx2` runs (marked `kernels`), so that AVX2-only kernels are held to it too."""
    for bug in BUGS:
        assert any(selected(t, "native") for t in bug.tests), (bug.name, "only slow tests catch it")
        if bug.path.startswith(KERNEL_CODE):
            assert any(selected(t, "avx2") for t in bug.tests), (bug.name, "no test marked kernels catches it")
