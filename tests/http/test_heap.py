"""The garbage collector while serving (`tserve/service/heap.py`): the start-up heap frozen once the models are
ready, thawed to free an unloaded model's cycles and when the server stops, and every collection's pause in the
metrics."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from tserve.service import heap
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.settings import Settings

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"


@pytest.fixture
def thawed():
    """The test process's heap as the suite keeps it: never left frozen, whatever the test did."""
    heap.thaw()
    yield
    heap.thaw()


def loaded_registry(**settings) -> ModelRegistry:  # noqa: ANN003 - Settings fields
    registry = ModelRegistry(Settings(models=[f"lm={TINY_LM}"], device="cpu", dtype="float32", log_level="warning",
                                      **settings), Metrics())
    registry.start_loading()
    registry.wait_loaded(timeout=120)
    assert registry.ready, registry.error
    return registry


def test_the_heap_is_frozen_once_the_models_are_ready_and_thawed_when_the_server_stops(thawed):
    registry = loaded_registry()
    try:
        model = registry.models["lm"].loaded.model
        assert gc.get_freeze_count() > 1000  # the model's modules, the tokenizer, the libraries' objects ...
        assert not any(o is model for o in gc.get_objects())  # ... this model among them (frozen: not listed)
    finally:
        registry.stop()
    assert gc.get_freeze_count() == 0


def test_without_gc_freeze_nothing_is_frozen(thawed):
    registry = loaded_registry(gc_freeze=False)
    try:
        assert gc.get_freeze_count() == 0
    finally:
        registry.stop()


def test_an_unloaded_model_is_freed_although_it_was_frozen(thawed):
    """A served model sits in reference cycles (its workers' callbacks hold it), which only the collector frees:
    the frozen heap must be thawed for that, and frozen again after."""
    registry = loaded_registry()
    try:
        served = weakref.ref(registry.models["lm"])
        assert gc.get_freeze_count() > 0
        registry.unload_model("lm")
        assert served() is None
        assert gc.get_freeze_count() > 0  # what serving keeps is frozen again
    finally:
        registry.stop()


def test_a_model_loaded_at_run_time_is_frozen_with_the_rest(thawed):
    registry = loaded_registry()
    try:
        registry.load_model("second", TINY_LM)
        model = registry.models["second"].loaded.model
        assert not any(o is model for o in gc.get_objects())
    finally:
        registry.stop()


def test_every_collection_is_timed_by_generation_until_closed():
    metrics = Metrics()

    def count(generation: int) -> float:
        return metrics.registry.get_sample_value("tserve_gc_pause_seconds_count", {"generation": str(generation)})

    observer = heap.PauseObserver(metrics.gc_pause)
    try:
        before = count(2), count(0)
        gc.collect()
        gc.collect(0)
        assert count(2) == before[0] + 1 and count(0) == before[1] + 1
        assert metrics.registry.get_sample_value("tserve_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        observer.close()
    gc.collect()
    assert count(2) == before[0] + 1
