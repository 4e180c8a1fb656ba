"""The percentile of every benchmark, simulation and summary in the project, and the
interleaved timing of the step benchmarks' sides."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

PERCENTILE_METHODS = ("linear", "nearest-rank")


def percentile(values: Sequence[float], q: float, method: str = "linear", empty: float | None = None) -> float:
    """The ``q``-th percentile of ``values``, ``q`` in [0, 100].

    Args:
        values: the sample, in any order.
        q: the percentile (50: the median).
        method: ``linear`` interpolates between the two closest ranks (numpy's
            default): what the bench reports quote. ``nearest-rank`` is the
            ``ceil(q / 100 * n)``-th smallest value (the first for ``q`` 0), always
            an observed value: what the simulators and the policies benchmark quote.
        empty: the value for no values; None raises.

    Raises:
        ValueError: no values (and ``empty`` is None), ``q`` outside [0, 100] or an
            unknown method.
    """
    if not 0 <= q <= 100 or method not in PERCENTILE_METHODS:
        raise ValueError(f"percentile: q must be in [0, 100] and method one of {PERCENTILE_METHODS}, "
                         f"got {q!r}, {method!r}")
    if not len(values):
        if empty is None:
            raise ValueError("percentile of no values")
        return empty
    if method == "linear":
        return float(np.percentile(values, q))
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s) / 100) - 1))]


def interleaved_ms(sides: dict[str, Callable[[], Any]], repeat: int) -> tuple[dict[str, dict[str, float]], dict]:
    """Times each of ``sides`` (name → a call) once a round, in order, over ``repeat + 1``
    rounds, the first a warm-up: interleaved, so a shared host's drift falls on every side.

    Returns:
        ``({side: {"wall": ms, "cpu": ms}}, {side: its last result})``: the median wall and
        thread-CPU milliseconds (rounded to 0.01) of each side.
    """
    times: dict[str, dict[str, list[float]]] = {side: {"wall": [], "cpu": []} for side in sides}
    results: dict[str, Any] = {}
    for r in range(repeat + 1):
        for side, call in sides.items():
            wall, cpu = time.perf_counter(), time.thread_time()
            results[side] = call()
            if r:
                times[side]["wall"].append(time.perf_counter() - wall)
                times[side]["cpu"].append(time.thread_time() - cpu)
    medians = {side: {k: round(statistics.median(v) * 1e3, 2) for k, v in d.items()} for side, d in times.items()}
    return medians, results
