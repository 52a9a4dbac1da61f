"""The fits `check` extrapolates with, past the N it can measure.

* a straight line through the two largest measured x (per-item work: every rank sends the same
  number of items, so it grows linearly in N, or in the chunks a checkpoint lists);
* a power law through the last two measured N (torch's validation: quadratic on 2.8.0).

benchmarks/extrapolation_error.py and benchmarks/cost_model_laws.py measure how far each is
from a direct measurement.
"""

from __future__ import annotations

import math


def extrapolate_linear(points: dict[int, float], n: int) -> float:
    """Straight line through the two largest measured x (the smallest can be degenerate:
    hsdp:8 at N=8 has no replicas); constant when there is only one x."""
    if len(points) == 1:
        return next(iter(points.values()))
    (n0, y0), (n1, y1) = sorted(points.items())[-2:]
    slope = (y1 - y0) / (n1 - n0)
    return max(y1 + slope * (n - n1), 0.0)


def log_log_slope(xs, ys) -> float:
    """Least-squares slope of log y against log x: the exponent of a power law."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def extrapolate_power(points: dict[int, float], n: int) -> tuple[float, float]:
    """Power law through the last two measured N; returns (value, exponent)."""
    (n0, y0), (n1, y1) = sorted(points.items())[-2:]
    exponent = log_log_slope([n0, n1], [max(y0, 1e-9), max(y1, 1e-9)])
    return y1 * (n / n1) ** exponent, exponent
