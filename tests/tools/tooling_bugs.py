"""Planted bugs of the measuring tools: the benchmarks' shared code (`bench/`) and the testing helpers that read
their results (`tserve/testing/`); part of `tests/tools/planted_bugs.py`'s list."""

from __future__ import annotations

from tests.tools.planted_bug import Bug

AMX_HAZARD = "tests/deploy/test_llama_cpp_bench.py::test_a_build_whose_amx_tile_configuration_gcc_drops_is_named_before_it_dies"

ROOFLINE = "tests/deploy/test_bench.py::test_roofline_benchmark_measures_bandwidth_bytes_and_steps"

TOOLING_BUGS = [
    Bug("device-busy-counts-annotations-as-work", "tserve/testing/device_busy.py",
        '{"kernel", "gpu_memcpy", "gpu_memset"}', '{"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}',
        ("tests/deploy/test_device_busy.py::test_a_profiler_trace_gives_the_device_busy_share_of_the_marked_run",)),
    Bug("a-benchmarks-scratch-directory-left-behind", "bench/scratch.py",
        "    atexit.register(shutil.rmtree, path, ignore_errors=True)\n", "",
        ("tests/deploy/test_bench.py::test_a_benchmarks_own_working_directory_goes_at_exit_and_a_given_one_stays",)),
    Bug("amx-hazard-misses-native-builds", "bench/llama_cpp.py",
        'built = "GGML_AMX_INT8" in on or ("GGML_NATIVE" in on and has_amx)', 'built = "GGML_AMX_INT8" in on',
        (f"{AMX_HAZARD}[native]", f"{AMX_HAZARD}[native-default-type]")),
    Bug("amx-hazard-blames-every-compiler", "bench/llama_cpp.py",
        "tile_header and TILE_CONFIG_AS_8_BYTES in tile_header", "True", (f"{AMX_HAZARD}[gcc13]", f"{AMX_HAZARD}[clang]")),
    Bug("core-round-trip-of-every-exchange-summed", "tserve/model/kernels/cpu_module.cpp",
        "best < 0.0 ? ns / iterations : std::min(best, ns / iterations);", "best < 0.0 ? ns : std::min(best, ns);",
        ("tests/deploy/test_bench.py::test_a_cache_lines_round_trip_between_two_cores_is_per_exchange", ROOFLINE)),
    Bug("roofline-product-rate-never-measured", "bench/memory_traffic.py",
        "    if isa is None:\n        return None\n", "    return None\n",
        ("tests/deploy/test_bench.py::test_the_q4_0_product_rate_is_its_blocks_bytes_over_one_calls_time", ROOFLINE)),
    Bug("roofline-product-rate-of-its-codes-alone", "bench/memory_traffic.py",
        "return (codes.numel() + scales.numel() * 2) / best / 1e9", "return codes.numel() / best / 1e9",
        ("tests/deploy/test_bench.py::test_the_q4_0_product_rate_is_its_blocks_bytes_over_one_calls_time",)),
]
