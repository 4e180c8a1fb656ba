"""Open-loop arrival times: a Poisson process at a given rate.

Open loop (vLLM's ``benchmark_serving --request-rate``): requests arrive on a
schedule of their own, whatever the server's speed, so queueing shows up in the
latencies once the rate exceeds what the server sustains. A Poisson process of
rate ``R`` requests/s has independent exponential gaps of mean ``1 / R`` s; the
first request arrives at 0. ``R = inf`` sends every request at once.

The gaps come from ``numpy.random.default_rng([seed, ARRIVAL_STREAM])``, a stream
of their own: the same seed gives the same workload and the same schedule, and
changing the rate leaves the requests as they are.
"""

from __future__ import annotations

import math

import numpy as np

ARRIVAL_STREAM = 2  # workload.WARMUP_STREAM is 1


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds from the start of the run, non-decreasing, the first 0.0.

    Args:
        num_requests: how many arrivals.
        rate: requests per second (> 0); ``math.inf``: all at 0.0.
        seed: the workload seed.

    Returns:
        ``num_requests`` offsets; offset ``i`` is the sum of ``i`` exponential gaps of mean ``1 / rate``.

    Raises:
        ValueError: ``rate`` <= 0 or NaN, or ``num_requests`` < 0.
    """
    if not rate > 0 or num_requests < 0:
        raise ValueError(f"request rate must be > 0 and num_requests >= 0, got {rate} and {num_requests}")
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng([seed, ARRIVAL_STREAM]).exponential(1.0 / rate, size=max(num_requests - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]
