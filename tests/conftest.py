"""Shared fixtures: tiny checkpoints built once per test session; and which skips are allowed.

A test may skip where something it needs is absent (a dev dependency, a browser, the test data, a GPU).
Under $TSERVE_CI (set by .ci/run) or $CI, every skip of a test not marked `gpu` (and every module skipped
at import, e.g. by `pytest.importorskip`) is a failure instead; $TSERVE_REQUIRE_GPU does the same for
tests marked `gpu`, for runs on a GPU machine. Without them, skips stay skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import factories  # noqa: E402
from tests.helpers.llama_family import FAMILIES  # noqa: E402

# Two threads at most, as on the 2-core machines the suite is timed on; one in each pytest-xdist worker, so
# that the workers (one per core) do not oversubscribe the cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))

CUDA = torch.cuda.is_available()
if not CUDA:
    # Without a GPU, Triton's interpreter runs our kernels on CPU tensors. It must be on before any kernel
    # module is imported (the @triton.jit decorator reads it).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


# The one place that decides which skips are allowed.
SKIPS_FAIL = next((name for name in ("TSERVE_CI", "CI") if _flag(name)), None)
GPU_SKIPS_FAIL = "TSERVE_REQUIRE_GPU" if _flag("TSERVE_REQUIRE_GPU") else None


def _forbidding_flag(node: pytest.Item | pytest.Collector) -> str | None:
    """The variable that forbids this node to skip, or None when it may."""
    if node.get_closest_marker("gpu") is not None:
        return GPU_SKIPS_FAIL
    return SKIPS_FAIL


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_skip(report, flag: str) -> None:
    report.outcome = "failed"
    report.longrepr = f"skipped, but ${flag} is set, so skipping is a failure: {_skip_reason(report)}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.skipped and (flag := _forbidding_flag(collector)):
        _fail_skip(report, flag)  # e.g. a module-level importorskip of a dev dependency
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and (flag := _forbidding_flag(item)):
        _fail_skip(report, flag)
    return report


# The modules that take longest (docs/TESTING.md, "Where the time goes"), started first: pytest-xdist hands each
# worker a module at a time in this order (the Makefile turns its own reordering off), so that no long module is
# left to run alone at the end while the other workers idle. The slow ones (`make test SLOW=1`, the AVX2 half; the
# browser tests) first, then those of `make test` by their measured time, longest first.
LONGEST_FIRST = (
    "tests/model/test_quantize.py", "tests/training/test_fixture_recipes.py", "tests/deploy/test_ray_serve.py",
    "tests/http/test_translation_page.py", "tests/http/test_viewer.py", "tests/model/test_flash_kernels.py",
    "tests/model/test_llama_family.py", "tests/training/test_gpu_session_train.py", "tests/deploy/test_bench.py",
    "tests/http/test_llama_family_http.py", "tests/engine/test_translation_engine.py", "tests/http/test_files.py",
    "tests/http/test_http.py", "tests/http/test_multilingual_http.py", "tests/http/test_oip.py",
    "tests/engine/test_worker_behaviour.py", "tests/model/test_bundled_models.py", "tests/http/test_repository.py",
    "tests/deploy/test_package.py", "tests/http/test_libretranslate.py", "tests/model/test_cpu_decode.py",
    "tests/http/test_http_contract.py", "tests/http/test_pivot_http.py", "tests/model/test_m2m100.py",
    "tests/model/test_block_kernels.py", "tests/engine/test_engine.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_gpt2(tmp_path_factory) -> Path:
    return factories.hf_gpt2_dir(tmp_path_factory.mktemp("hf-gpt2"))


@pytest.fixture(scope="session")
def hf_marian(tmp_path_factory) -> Path:
    return factories.hf_marian_dir(tmp_path_factory.mktemp("hf-marian"))


@pytest.fixture(scope="session")
def hf_vit(tmp_path_factory) -> Path:
    return factories.hf_vit_dir(tmp_path_factory.mktemp("hf-vit"))


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory) -> Path:
    return factories.tiny_lm_dir(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="session")
def tiny_mt(tmp_path_factory) -> Path:
    return factories.tiny_mt_dir(tmp_path_factory.mktemp("tiny-mt"))


@pytest.fixture(scope="session")
def tiny_vit(tmp_path_factory) -> Path:
    return factories.tiny_vit_dir(tmp_path_factory.mktemp("tiny-vit"))


@pytest.fixture(scope="session", params=FAMILIES)
def hf_family(request, tmp_path_factory) -> tuple[str, Path]:
    """(family, directory): each trained Llama-family checkpoint in turn (tests/helpers/llama_family.py)."""
    return request.param, factories.hf_family_dir(request.param, tmp_path_factory.mktemp(f"hf-{request.param}"))
