"""The GPU benchmark's "device busy" figure (tserve/testing/device_busy.py): the union of the device's kernel, copy
and fill intervals over a run's wall window, checked on hand-made intervals and a hand-made profiler trace."""

from __future__ import annotations

import pytest

from tserve.testing.device_busy import busy_fraction, trace_busy, union_length


def test_overlapping_intervals_count_once():
    # two streams: [0, 4) and [2, 6) overlap on [2, 4); [5, 7) overlaps the second; [10, 11) stands alone;
    # [3, 3.5) lies inside the others; an empty interval adds nothing
    intervals = [(2.0, 6.0), (0.0, 4.0), (10.0, 11.0), (5.0, 7.0), (3.0, 3.5), (8.0, 8.0)]
    assert union_length(intervals) == pytest.approx(8.0)  # [0, 7) and [10, 11); a plain sum would be 12.5
    assert union_length([]) == 0.0


def test_the_busy_fraction_counts_only_the_window():
    intervals = [(-5.0, 1.0), (2.0, 3.0), (2.5, 4.0), (9.0, 20.0)]
    # inside [0, 10): [0, 1), [2, 4), [9, 10) = 4 of 10
    assert busy_fraction(intervals, (0.0, 10.0)) == pytest.approx(0.4)
    assert busy_fraction([(0.0, 10.0), (0.0, 10.0)], (0.0, 10.0)) == pytest.approx(1.0)  # never above 1
    with pytest.raises(ValueError):
        busy_fraction(intervals, (3.0, 3.0))


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


def test_a_profiler_trace_gives_the_device_busy_share_of_the_marked_run():
    trace = {"traceEvents": [
        _event("user_annotation", "run", 1000.0, 1000.0),  # the wall window: 1,000 µs
        _event("gpu_user_annotation", "run", 1000.0, 1000.0),  # the same range drawn on the GPU row: not work
        _event("cpu_op", "aten::mm", 1000.0, 900.0),  # host work
        _event("cuda_runtime", "cudaGraphLaunch", 1010.0, 5.0),
        _event("kernel", "gemm", 1100.0, 200.0),  # stream 1
        _event("kernel", "attention", 1200.0, 200.0),  # stream 2, overlapping the gemm by 100
        _event("gpu_memcpy", "Memcpy DtoH", 1500.0, 50.0),
        _event("gpu_memset", "Memset", 1600.0, 50.0),
        _event("kernel", "warm-up", 500.0, 600.0),  # before the window: 100 µs of it inside
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1700.0},  # not a duration event
    ]}
    busy, window_s, events = trace_busy(trace, "run")
    assert busy == pytest.approx((300.0 + 50.0 + 50.0 + 100.0) / 1000.0)
    assert window_s == pytest.approx(0.001) and events == 5


def test_a_trace_without_device_activity_or_window_is_no_figure():
    with pytest.raises(LookupError, match="no device activity"):
        trace_busy({"traceEvents": [_event("user_annotation", "run", 0.0, 10.0)]}, "run")
    with pytest.raises(LookupError, match="no host range"):
        trace_busy({"traceEvents": [_event("kernel", "k", 0.0, 10.0)]}, "run")
