"""Summary statistics of measured samples."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    data = list(values)
    return statistics.fmean(data) if data else float("nan")
