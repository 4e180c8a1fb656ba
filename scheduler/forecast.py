"""Forecast of a seasonal load series: Holt-Winters exponential smoothing.

Pure (no gRPC, no clock). ``SeasonalForecaster.forecast(history, steps)`` fits
additive Holt-Winters (level + one additive season, no trend; Holt 1957,
Winters 1960; the implementation is ``statsmodels.tsa.holtwinters.
ExponentialSmoothing``) to a series of per-interval rates and returns the next
``steps`` values, clamped at 0.

Cost: an optimized fit (smoothing parameters and initial state estimated by
maximum likelihood) takes ~0.5 s for a week of 5-minute intervals, so it runs
once per ``refit_every`` new points (points added to the series, counted even
once the caller's history is full and drops its oldest); in between, the last
optimized smoothing parameters are reused with a heuristic initial state (one
linear pass, ~50 ms). The heuristic needs 10 + 2 × (season // 2) points, more
than two seasons under 9 points a season: a shorter history gets the optimized
fit every time (cheap at that length). With fewer than two whole seasons of
history there is nothing seasonal to fit: ``forecast`` returns None and the
caller falls back to its reactive rule.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np


class SeasonalForecaster:
    """Holt-Winters forecasts of one series with a season of ``season_length`` points.

    Args:
        season_length: points per season (e.g. a day of 5-minute intervals: 288); >= 2.
        refit_every: new points after which the smoothing parameters are
            optimized again (default: one season).

    Raises:
        ValueError: ``season_length`` < 2 or ``refit_every`` < 1.
    """

    def __init__(self, season_length: int, refit_every: int | None = None):
        if season_length < 2:
            raise ValueError(f"season_length must be >= 2, got {season_length}")
        self.season_length = season_length
        self.refit_every = refit_every or season_length
        if self.refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {self.refit_every}")
        self._params: dict[str, float] | None = None
        self._fitted_at = -1  # points seen at the last optimized fit

    def ready(self, num_points: int) -> bool:
        """Whether ``num_points`` of history are enough to forecast (two whole seasons)."""
        return num_points >= 2 * self.season_length

    @property
    def fitted_at(self) -> int:
        """Points seen (``forecast``'s ``seen``) at the last optimized fit; -1 before the first."""
        return self._fitted_at

    def forecast(self, history: Sequence[float], steps: int, seen: int | None = None) -> np.ndarray | None:
        """The next ``steps`` values after ``history`` (float64, shape ``(steps,)``, >= 0),
        or None with fewer than two seasons of history.

        Args:
            history: the series' latest points, oldest first.
            steps: points to forecast (>= 1).
            seen: points the series has had in all, those dropped off ``history``'s front
                included (default ``len(history)``): re-fits are counted on it.

        Raises:
            ValueError: ``steps`` < 1.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        y = np.asarray(history, dtype=np.float64)
        if not self.ready(len(y)):
            return None
        seen = len(y) if seen is None else seen
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter on flat or short series
            result = None
            if self._params is not None and seen - self._fitted_at < self.refit_every:
                try:
                    model = ExponentialSmoothing(y, trend=None, seasonal="add",
                                                 seasonal_periods=self.season_length,
                                                 initialization_method="heuristic")
                    result = model.fit(optimized=False, **self._params)
                except ValueError:
                    result = None  # too few points for the heuristic initial state: fit fully
            if result is None:
                model = ExponentialSmoothing(y, trend=None, seasonal="add", seasonal_periods=self.season_length,
                                             initialization_method="estimated")
                result = model.fit()
                self._params = {"smoothing_level": float(result.params["smoothing_level"]),
                                "smoothing_seasonal": float(result.params["smoothing_seasonal"])}
                self._fitted_at = seen
            out = np.asarray(result.forecast(steps), dtype=np.float64)
        return np.maximum(np.nan_to_num(out, nan=0.0), 0.0)
