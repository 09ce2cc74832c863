"""Percentiles of timed samples, as the benchmarks report them."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The sample at fraction ``q`` (0..1) of the sorted values, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
