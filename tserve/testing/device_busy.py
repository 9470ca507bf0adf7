"""How much of a run's wall time the GPU was busy, from a profiler trace (bench/gpu.py's "device busy" rows).

The device is busy while any kernel, copy or fill runs on it. Kernels on several streams overlap, so busy time is
the length of the UNION of those intervals, never their sum; only the part inside the run's wall window (first
request submitted .. last one finished) counts. CUPTI reports the kernels replayed from a CUDA graph one by one, as
`kernel` events, so a graph replay is measured like eager launches.
"""

from __future__ import annotations

from collections.abc import Iterable

# Chrome-trace categories of torch.profiler (Kineto) that occupy the device; `gpu_user_annotation` is a
# record_function range drawn over the GPU row, not work, and stays out.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals [start, end), each point counted once however many cover it."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def busy_fraction(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """The fraction of `window` covered by the union of `intervals` (each clipped to the window)."""
    lo, hi = window
    if hi <= lo:
        raise ValueError(f"empty window {window}")
    clipped = ((max(s, lo), min(e, hi)) for s, e in intervals)
    return union_length(clipped) / (hi - lo)


def trace_busy(trace: dict, window_name: str) -> tuple[float, float, int]:
    """(busy fraction, window seconds, device events) of a torch.profiler Chrome trace (`export_chrome_trace`'s
    JSON, times in microseconds): the device events' union over the host range `record_function(window_name)`
    marked. Raises LookupError when the trace has no such range or no device activity at all (CUPTI missing)."""
    events = trace.get("traceEvents", [])
    marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == window_name]
    if not marks:
        raise LookupError(f"no host range named {window_name!r} in the trace")
    window = (float(marks[0]["ts"]), float(marks[0]["ts"]) + float(marks[0]["dur"]))
    device = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
              if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        raise LookupError("no device activity in the trace (is CUPTI available?)")
    return busy_fraction(device, window), (window[1] - window[0]) / 1e6, len(device)
