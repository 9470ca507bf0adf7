"""Shared fixtures: tiny checkpoints built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import factories  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

CUDA = torch.cuda.is_available()
if not CUDA:
    # Without a GPU, Triton's interpreter runs our kernels on CPU tensors. It must be on before any kernel
    # module is imported (the @triton.jit decorator reads it).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
