"""Queue-wait estimates for the Admit stream's queue events and retry delays.

With a measured service rate — tokens (prompt + completion) of the last
``window`` released leases that reported completion tokens, divided by the
seconds between the first and the last of those releases — the wait of a queued
request is

    predicted cost of the requests up to and including it (tokens) / rate (tokens/s)

(``cost`` = prompt tokens + n × predicted output tokens, ``scheduler.admission``).
Before a rate is known it falls back to (position + 1) × the mean gap between
the last ``window`` dispatches, and 0 before two dispatches.
"""

from __future__ import annotations

from collections import deque


class WaitEstimator:
    """Recent dispatches and releases → estimated queue waits (seconds)."""

    def __init__(self, window: int = 64):
        self._dispatch_times: deque[float] = deque(maxlen=window)
        self._releases: deque[tuple[float, int]] = deque(maxlen=window)

    def on_dispatch(self, now: float) -> None:
        """Records one assignment at clock time ``now``."""
        self._dispatch_times.append(now)

    def on_release(self, now: float, tokens: int) -> None:
        """Records a finished lease that served ``tokens`` (prompt + completion)."""
        self._releases.append((now, tokens))

    def service_rate(self) -> float | None:
        """Tokens per second served recently, or None when not measured."""
        if len(self._releases) < 2:
            return None
        span = self._releases[-1][0] - self._releases[0][0]
        if span <= 0:
            return None
        return sum(tokens for _, tokens in list(self._releases)[1:]) / span

    def estimate(self, tokens_ahead: float, position: int) -> float:
        """Seconds until the request at ``position`` (``tokens_ahead`` up to it) is assigned."""
        rate = self.service_rate()
        if rate:
            return tokens_ahead / rate
        if len(self._dispatch_times) < 2:
            return 0.0
        span = self._dispatch_times[-1] - self._dispatch_times[0]
        return (max(0, position) + 1) * span / (len(self._dispatch_times) - 1)
