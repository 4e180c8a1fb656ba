"""The planner: how many executors the mesh should have, ahead of the load.

Pure (no gRPC; the clock is passed in). The scheduler feeds it every admitted
request (``on_arrival``: requests and tokens), every finished lease
(``on_served``: tokens processed) and every executor's measured cold start
(``on_cold_start``: process start → registered, seconds); a loop
(``scheduler.planner_loop``) calls ``decide`` once per ``interval_s``.

**History.** Arrivals are counted in intervals of ``interval_s`` seconds; each
closed interval adds its token load (tokens/s: prompt + n × predicted output
tokens of the requests that arrived in it, the admission core's ``cost``) and
arrival rate (requests/s) to the history (an interval with no arrivals adds 0).
At most ``history_seasons`` seasons are kept.

**Capacity of one executor** (tokens/s). An interval in which requests waited
in the admission queue at every observation (``observe``: the queue left after
a dispatch; the mesh was saturated throughout) and some finished gives a
sample: tokens served in it / (``interval_s`` × executors); the capacity is the
mean of the last ``CAPACITY_SAMPLES`` samples, ``capacity_tokens_per_s`` until
there is one. (A queue seen only for a moment, as each arrival waits for its
dispatch, says nothing of capacity: the tokens served then are bounded by the
arrivals, and counting such an interval would shrink the capacity to the load.)

**Cold start** (seconds): the largest of the last ``COLD_START_SAMPLES``
measured cold starts, ``cold_start_s`` until there is one.

**Decision** (every interval)::

    lead        = cold start + interval_s
    forecast    = max of the Holt-Winters forecast of the token load over the
                  next ceil(lead / interval_s) intervals (scheduler.forecast;
                  needs two seasons of history)
    predictive  = ceil(forecast / (capacity × target_utilization))
    reactive    = ceil((last interval's load + queued tokens / interval_s)
                       / (capacity × target_utilization))          (the floor)
    raw         = clamp(max(predictive, reactive), min_executors, max_executors)

so executors are asked for one cold start before the forecast load needs them
(pre-warming), and a forecast miss is covered one interval later by the
reactive floor. With ``predictive`` off (or too little history) raw is the
reactive term alone: that is the reactive autoscaler the simulation compares.

**Stabilization** (no flapping): a larger raw count is taken at once;
a smaller one only after raw has stayed below the current count for
``scale_down_cooldown_s`` and at least that long after the last change, and
then one executor at a time (each further step waits another cooldown).

**Idle timer from readiness** (cold starts). The scale-down timer
runs only while more executors are *ready* (registered, not draining; from
``observe``) than raw asks for, i.e. while a ready executor idles. While every
ready executor is needed and the surplus of ``desired`` over raw is made of
executors still starting, the timer is held (reset), so an executor asked for
is never given up before it is ready: at scale-to-zero, the executor started
for a request waits out the idle window *after* its readiness. The hold lasts
only while demand is recent (``observe`` saw a request queued within the last
cold start + ``interval_s``): an executor that never becomes ready is not
restarted for ever with nothing queued, and the mesh returns to zero. A step down then
removes a starting executor first (``meshserve.cli.autoscale.plan``), so the
ready count never falls below raw. With no ``observe`` call yet (the planner
alone) the timer is never held.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

from scheduler.forecast import SeasonalForecaster

CAPACITY_SAMPLES = 8
COLD_START_SAMPLES = 5


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's settings (seconds, tokens/s).

    Attributes:
        interval_s: one history point and one decision per interval.
        season_s: the season of the load (a day); a multiple of ``interval_s``.
        min_executors, max_executors: bounds of the desired count (min may be 0).
        capacity_tokens_per_s: one executor's capacity until one is measured.
        cold_start_s: an executor's cold start until one is measured.
        target_utilization: the fraction of capacity planned for (headroom for noise).
        scale_down_cooldown_s: see the module docstring (stabilization).
        history_seasons: seasons of history kept.
        predictive: forecast (True) or reactive only (False).

    Raises:
        ValueError: a setting out of range (``validate``).
    """

    interval_s: float = 60.0
    season_s: float = 86400.0
    min_executors: int = 1
    max_executors: int = 8
    capacity_tokens_per_s: float = 2000.0
    cold_start_s: float = 60.0
    target_utilization: float = 0.8
    scale_down_cooldown_s: float = 300.0
    history_seasons: int = 14
    predictive: bool = True

    def __post_init__(self) -> None:
        numbers = (self.interval_s, self.season_s, self.capacity_tokens_per_s, self.cold_start_s,
                   self.scale_down_cooldown_s, self.target_utilization)
        if not all(math.isfinite(v) for v in numbers):
            raise ValueError("planner settings must be finite numbers (interval, season, capacity, cold start, "
                             f"cooldown, utilization), got {numbers}")
        if self.interval_s <= 0 or self.season_s < 2 * self.interval_s:
            raise ValueError(f"need interval_s > 0 and season_s >= 2 intervals, got {self.interval_s}, "
                             f"{self.season_s}")
        if abs(self.season_s / self.interval_s - round(self.season_s / self.interval_s)) > 1e-6:
            raise ValueError(f"season_s ({self.season_s}) must be a multiple of interval_s ({self.interval_s})")
        if not 0 <= self.min_executors <= self.max_executors or self.max_executors < 1:
            raise ValueError(f"need 0 <= min_executors <= max_executors, max >= 1; got "
                             f"{self.min_executors}..{self.max_executors}")
        if self.capacity_tokens_per_s <= 0 or self.cold_start_s < 0 or self.scale_down_cooldown_s < 0:
            raise ValueError("capacity_tokens_per_s must be > 0, cold_start_s and scale_down_cooldown_s >= 0")
        if not 0 < self.target_utilization <= 1 or self.history_seasons < 2:
            raise ValueError("target_utilization must be in (0, 1] and history_seasons >= 2")

    @property
    def season_length(self) -> int:
        """Intervals per season."""
        return round(self.season_s / self.interval_s)


@dataclass(frozen=True)
class Decision:
    """One decision (``Planner.decide``).

    Attributes:
        desired: executors the mesh should have now (stabilized).
        raw: the count before stabilization.
        predictive: the forecast's count, or None (no forecast).
        reactive: the reactive floor's count.
        forecast_tokens_per_s: the largest forecast load within the lead (0 without one).
        forecast_requests_per_s: the largest forecast arrival rate within the lead (0 without one).
        load_tokens_per_s: the last closed interval's load.
        capacity_tokens_per_s: one executor's capacity used.
        cold_start_s: the cold start used.
        lead_s: how far ahead the forecast looked (cold start + interval).
    """

    desired: int
    raw: int
    predictive: int | None
    reactive: int
    forecast_tokens_per_s: float
    forecast_requests_per_s: float
    load_tokens_per_s: float
    capacity_tokens_per_s: float
    cold_start_s: float
    lead_s: float


@dataclass(frozen=True)
class History:
    """A copy of the planner's history: per-interval token loads (tokens/s) and arrival
    rates (requests/s), oldest first, how many intervals to forecast, and how many
    intervals have closed in all (the forecasters re-fit on it once the history is full)."""

    tokens: list[float]
    requests: list[float]
    steps: int
    closed: int


@dataclass(frozen=True)
class Forecast:
    """The largest forecast values within the lead (tokens/s, requests/s)."""

    tokens_per_s: float
    requests_per_s: float


class Planner:
    """History, capacity and cold-start measurements, and the decision (module docstring)."""

    def __init__(self, config: PlannerConfig, start: float = 0.0):
        self.config = config
        keep = config.season_length * config.history_seasons
        self.tokens_history: deque[float] = deque(maxlen=keep)  # tokens/s per closed interval
        self.requests_history: deque[float] = deque(maxlen=keep)  # requests/s per closed interval
        self._tokens_forecaster = SeasonalForecaster(config.season_length)
        self._requests_forecaster = SeasonalForecaster(config.season_length)
        self._bucket_end = start + config.interval_s
        self.intervals_closed = 0  # intervals added to the history, those since dropped included
        self._tokens = 0.0
        self._requests = 0
        self._served = 0.0
        self._saturated = True  # every observation in this interval saw a queue (and executors)
        self._observed = False  # some observation in this interval
        self._executors = 0
        self._capacity: deque[float] = deque(maxlen=CAPACITY_SAMPLES)
        self._cold_starts: deque[float] = deque(maxlen=COLD_START_SAMPLES)
        self.desired = config.min_executors
        self._last_change = -math.inf
        self._below_since: float | None = None
        self.ready: int | None = None  # ready executors at the last observe (None: never observed)
        self._queued_at = -math.inf  # the last observe that saw a request queued
        self.last: Decision | None = None

    # -- observations ----------------------------------------------------------
    def on_arrival(self, now: float, num_tokens: int, num_requests: int = 1) -> None:
        """``num_requests`` requests arrived at ``now`` (seconds) with ``num_tokens`` of work
        (prompt + n × predicted output tokens, all of them together: the scheduler passes
        each request's admission ``cost``)."""
        self._roll(now)
        self._requests += num_requests
        self._tokens += num_tokens

    def on_served(self, now: float, num_tokens: int) -> None:
        """A lease ended at ``now`` after ``num_tokens`` were processed (prompt + completion)."""
        self._roll(now)
        self._served += num_tokens

    def on_cold_start(self, seconds: float) -> None:
        """An executor took ``seconds`` from its process start to registration; a negative or
        non-finite value (NaN, infinity: nothing to plan for) is ignored."""
        if math.isfinite(seconds) and seconds >= 0:
            self._cold_starts.append(seconds)

    def observe(self, now: float, num_executors: int, num_queued: int) -> None:
        """The mesh's state at ``now``: ready executors and requests left queued after a
        dispatch (called on every change or at least once per interval: saturation is
        sampled here)."""
        self._roll(now)
        self.ready = num_executors
        self._executors = max(self._executors, num_executors)
        self._saturated = self._saturated and num_queued > 0 and num_executors > 0
        self._observed = True
        if num_queued > 0:
            self._queued_at = now

    @property
    def capacity_tokens_per_s(self) -> float:
        """One executor's measured capacity (the configured one until measured)."""
        return sum(self._capacity) / len(self._capacity) if self._capacity else self.config.capacity_tokens_per_s

    @property
    def cold_start_s(self) -> float:
        """The cold start planned for (the largest recent measurement, else configured)."""
        return max(self._cold_starts) if self._cold_starts else self.config.cold_start_s

    def _roll(self, now: float) -> None:
        """Closes every interval that ended by ``now`` (empty ones add zeros)."""
        cfg = self.config
        while now >= self._bucket_end:
            self.tokens_history.append(self._tokens / cfg.interval_s)
            self.requests_history.append(self._requests / cfg.interval_s)
            if self._observed and self._saturated and self._executors > 0 and self._served > 0:
                self._capacity.append(self._served / (cfg.interval_s * self._executors))
            self._tokens, self._requests, self._served = 0.0, 0, 0.0
            self._saturated, self._observed, self._executors = True, False, 0
            self._bucket_end += cfg.interval_s
            self.intervals_closed += 1

    # -- the decision ----------------------------------------------------------
    def snapshot(self, now: float) -> History:
        """Closes the intervals ended by ``now`` and copies the history (for ``forecast``,
        which may then run in another thread)."""
        self._roll(now)
        steps = max(1, math.ceil((self.cold_start_s + self.config.interval_s) / self.config.interval_s))
        return History(list(self.tokens_history), list(self.requests_history), steps, self.intervals_closed)

    def forecast(self, history: History) -> Forecast | None:
        """The largest forecast load and arrival rate over ``history.steps`` intervals, or
        None (predictive off, or under two seasons of history). Touches only the
        forecasters: safe in a worker thread while the planner observes."""
        if not self.config.predictive:
            return None
        tokens = self._tokens_forecaster.forecast(history.tokens, history.steps, history.closed)
        if tokens is None:
            return None
        requests = self._requests_forecaster.forecast(history.requests, history.steps, history.closed)
        return Forecast(float(tokens.max()), float(requests.max()) if requests is not None else 0.0)

    def decide(self, now: float, num_queued_tokens: int = 0, forecast: Forecast | None | bool = True) -> Decision:
        """The desired executor count at ``now`` (see the module docstring).

        Args:
            now: clock time (seconds).
            num_queued_tokens: prompt tokens waiting in the admission queue.
            forecast: a ``forecast`` computed from ``snapshot(now)`` (or None: no
                forecast); True computes it here.
        """
        if forecast is True:
            forecast = self.forecast(self.snapshot(now))
        self._roll(now)
        cfg = self.config
        per_executor = self.capacity_tokens_per_s * cfg.target_utilization
        lead = self.cold_start_s + cfg.interval_s
        load = self.tokens_history[-1] if self.tokens_history else 0.0
        reactive = math.ceil((load + num_queued_tokens / cfg.interval_s) / per_executor - 1e-9)
        predictive, f_tokens, f_requests = None, 0.0, 0.0
        if forecast is not None:
            f_tokens, f_requests = forecast.tokens_per_s, forecast.requests_per_s
            predictive = math.ceil(f_tokens / per_executor - 1e-9)
        raw = max(reactive, predictive or 0)
        raw = min(cfg.max_executors, max(cfg.min_executors, raw))
        self._stabilize(now, raw)
        self.last = Decision(self.desired, raw, predictive, reactive, f_tokens, f_requests, load,
                             self.capacity_tokens_per_s, self.cold_start_s, lead)
        return self.last

    def wake_from_zero(self, now: float, num_queued: int) -> Decision | None:
        """Scale to zero: requests queued while no executor is ready and the
        planner wants none ask for one at once, not at the next interval (a request
        must wait only for an executor's start). Returns the new decision, or None
        when nothing changed (executors are wanted already, one is ready, or none is
        queued)."""
        if num_queued <= 0 or self.desired > 0 or (self.ready or 0) > 0:
            return None
        self.desired, self._last_change, self._below_since = 1, now, None
        if self.last is None:
            self.last = Decision(1, 1, None, 1, 0.0, 0.0, 0.0, self.capacity_tokens_per_s, self.cold_start_s,
                                 self.cold_start_s + self.config.interval_s)
        else:
            self.last = dataclasses.replace(self.last, desired=1, raw=max(1, self.last.raw))
        return self.last

    def demand_recent(self, now: float) -> bool:
        """Whether ``observe`` saw a request queued within the last cold start + interval
        before ``now`` (seconds): the idle timer is held for executors still starting only
        then, so one that never becomes ready is not restarted for ever with nothing queued."""
        return now - self._queued_at <= self.cold_start_s + self.config.interval_s

    def _stabilize(self, now: float, raw: int) -> None:
        cooldown = self.config.scale_down_cooldown_s
        if raw >= self.desired:
            self._below_since = None
            if raw > self.desired:
                self.desired, self._last_change = raw, now
            return
        if self.ready is not None and self.ready <= raw and self.demand_recent(now):
            self._below_since = None  # no ready executor idles: the surplus is still starting
            return
        if self._below_since is None:
            self._below_since = now
        if now - self._below_since >= cooldown and now - self._last_change >= cooldown:
            self.desired -= 1
            self._last_change = now
            self._below_since = now if raw < self.desired else None
