"""Planted bugs of the measuring tools: the benchmarks' shared code (`bench/`) and the testing helpers that read
their results (`tserve/testing/`); part of `tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

TOOLING_BUGS = [
    Bug("device-busy-counts-annotations-as-work", "tserve/testing/device_busy.py",
        '{"kernel", "gpu_memcpy", "gpu_memset"}', '{"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}',
        ("tests/deploy/test_device_busy.py::test_a_profiler_trace_gives_the_device_busy_share_of_the_marked_run",)),
    Bug("a-benchmarks-scratch-directory-left-behind", "bench/scratch.py",
        "    atexit.register(shutil.rmtree, path, ignore_errors=True)\n", "",
        ("tests/deploy/test_bench.py::test_a_benchmarks_own_working_directory_goes_at_exit_and_a_given_one_stays",)),
]
