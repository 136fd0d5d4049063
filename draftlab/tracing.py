"""How busy a GPU was in a traced window: the union of its kernels' intervals over the window.

A kernel-time sum over-counts when kernels overlap (several streams, several processes on one
GPU) and says nothing about the gaps between them; the union is the share of the wall time in
which at least one kernel ran. Below ~90%, something other than the kernels (the host launching
them, a wait on the host, another process's turn) bounds the work.
"""
from __future__ import annotations


def union_us(intervals, lo: float, hi: float) -> float:
    """Microseconds of [lo, hi] covered by at least one (start, stop, ...) interval."""
    covered, end = 0.0, lo
    for start, stop, *_ in sorted(intervals):
        start, stop = max(start, end), min(stop, hi)
        if stop > start:
            covered += stop - start
            end = stop
    return covered


def gpu_busy_share(events) -> float | None:
    """torch.profiler events: the share of the traced window (first to last event, host or GPU) in
    which a GPU kernel ran; None where no GPU kernel was traced (a CPU run)."""
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA"]
    if not kernels:
        return None
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return union_us(kernels, lo, hi) / max(hi - lo, 1e-9)
