"""What every benchmark row reports about a timed quantity: median, interquartile range, rounds.

Not a benchmark itself (benchmarks/run.py runs ``bench_*.py`` only).

>>> spread([1.0, 2.0, 3.0, 4.0, 100.0])
'3.000 (IQR 2.000-4.000, n=5)'
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return at(0.25), statistics.median(xs), at(0.75)


def spread(values: Sequence[float], fmt: str = ".3f", scale: float = 1.0) -> str:
    """``median (IQR q1-q3, n=N)`` of ``values`` (each multiplied by ``scale``)."""
    q1, med, q3 = (v * scale for v in quartiles(values))
    return f"{med:{fmt}} (IQR {q1:{fmt}}-{q3:{fmt}}, n={len(values)})"
