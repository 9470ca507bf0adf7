"""The lines a waiting thread of a decode step asks for (`kernels/step_team.h`, `UpcomingLines`): the first lines of
its own chunk of the next product's weights, as the team's loops split that product (`chunk_of`: at most one chunk a
thread, contiguous, in thread order), at most 64 KB of them, and the scales of the same items alongside. A prefetch
changes no result, so what guards it is the lines themselves: another thread's chunk, or scales left behind, would
make a wait useless without any step's logits showing it."""

from __future__ import annotations

import math

import pytest

from tserve.model.kernels import cpu

pytestmark = pytest.mark.kernels

CAP = 64 * 1024
SCALES = 1 << 40  # the binding's offset for a scales' line


def chunks(items: int, threads: int) -> list[tuple[int, int]]:
    """The split the team's loops make of `items` (grain 1), stated in Python."""
    count = min(threads, items)
    size = math.ceil(items / count)
    return [(min(items, t * size), min(items, (t + 1) * size)) for t in range(threads)]


@pytest.fixture(scope="module")
def kernels():
    built = cpu.extension()
    if built is None:
        pytest.skip("the CPU kernels are not built on this machine")
    return built


# (items, item bytes, scale bytes, threads): SmolLM2-135M's Q4_0 q/k/v panels; Q8_0 down panels past the cap; a
# float32 product (no scales); more threads than items; chunks of unequal lengths.
CASES = [(60, 18 * 256, 18 * 32, 2), (36, 48 * 512, 48 * 32, 2), (24, 24 * 576 * 4, 0, 2), (2, 4608, 576, 4),
         (7, 1000, 100, 3)]


@pytest.mark.parametrize(("items", "item_bytes", "scale_bytes", "threads"), CASES)
def test_each_thread_asks_for_the_first_lines_of_its_own_chunk(kernels, items, item_bytes, scale_bytes, threads):
    asked = kernels.upcoming_lines(items, item_bytes, scale_bytes, threads)
    for t, (first, last) in enumerate(chunks(items, threads)):
        weights = [a for a in asked[t] if a < SCALES]
        nbytes = min((last - first) * item_bytes, CAP)
        assert weights == list(range(first * item_bytes, first * item_bytes + nbytes, 64)), f"thread {t}"


@pytest.mark.parametrize(("items", "item_bytes", "scale_bytes", "threads"), CASES)
def test_the_scales_of_the_same_items_come_alongside(kernels, items, item_bytes, scale_bytes, threads):
    asked = kernels.upcoming_lines(items, item_bytes, scale_bytes, threads)
    for t, (first, last) in enumerate(chunks(items, threads)):
        scales = [a - SCALES for a in asked[t] if a >= SCALES]
        weight_bytes = min((last - first) * item_bytes, CAP)
        start, covered = first * scale_bytes, weight_bytes * scale_bytes // item_bytes
        assert scales == list(range(start, start + len(scales) * 64, 64)), f"thread {t}: contiguous from its first item"
        assert len(scales) * 64 >= covered, f"thread {t}: the scales of every weight byte asked for"
        assert len(scales) * 64 < covered + 128, f"thread {t}: not past them"
        # Paced with the weights: by the weights' middle line, the scales of the first half are asked for.
        middle = len([a for a in asked[t] if a < SCALES]) // 2
        before = [a for a in asked[t][:asked[t].index(first * item_bytes + 64 * middle)] if a >= SCALES] \
            if middle else []
        assert len(before) * 64 >= middle * 64 * scale_bytes // item_bytes, f"thread {t}: scales keep pace"
