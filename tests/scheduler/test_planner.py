"""The planner without gRPC: Holt-Winters forecast error, the lead over a peak,
measured capacity and cold start, stabilization (C43)."""

import math

import numpy as np
import pytest

from scheduler.forecast import SeasonalForecaster
from scheduler.planner import Forecast, Planner, PlannerConfig

DAY = 86400.0
INTERVAL = 300.0  # 288 intervals a day


def diurnal(t: np.ndarray) -> np.ndarray:
    """Noise-free token load (tokens/s) at times ``t``: 2,000 at night, 10,000 at 15:00."""
    phase = 2 * math.pi * (t % DAY) / DAY
    return 6000.0 - 4000.0 * np.cos(phase - 2 * math.pi * 3 / 24)


def feed(planner: Planner, loads: np.ndarray, start: float, rng: np.random.Generator) -> None:
    """One interval's arrivals per load value (Poisson requests of 500 tokens), closed by the next."""
    for i, load in enumerate(loads):
        requests = int(rng.poisson(load * INTERVAL / 500))
        planner.on_arrival(start + i * INTERVAL, requests * 500, requests)


def test_forecast_of_a_seeded_diurnal_trace_is_within_five_percent():
    """Three days of Poisson arrivals around a daily cosine; the next hour's forecast
    is within 5 % mean absolute percentage error of the true mean load."""
    rng = np.random.default_rng(7)
    times = np.arange(3 * 288) * INTERVAL
    planner = Planner(PlannerConfig(interval_s=INTERVAL, season_s=DAY, predictive=True))
    feed(planner, diurnal(times), 0.0, rng)
    planner.decide(3 * DAY)
    assert len(planner.tokens_history) == 3 * 288
    forecast = SeasonalForecaster(288).forecast(planner.tokens_history, 12)
    truth = diurnal(3 * DAY + np.arange(12) * INTERVAL)
    mape = float(np.mean(np.abs(forecast - truth) / truth))
    assert mape < 0.05, mape


def test_forecaster_needs_two_seasons():
    f = SeasonalForecaster(4)
    assert f.forecast([1.0] * 7, 2) is None
    assert f.forecast([1.0, 2.0, 3.0, 4.0] * 2, 2) is not None
    with pytest.raises(ValueError):
        SeasonalForecaster(1)


def test_forecaster_re_fits_once_per_season_of_new_points_after_the_history_is_full():
    """Season 12, history capped at two seasons (24 points, its oldest dropped as each new
    one closes): the optimized fit runs at 24 points seen and every 12 more (36 ... 144),
    counted on the points seen, not on the capped history's length."""
    f = SeasonalForecaster(12)
    series = [float((i * 7) % 12) for i in range(150)]
    fits = []
    for seen in range(24, 150):
        f.forecast(series[seen - 24:seen], 1, seen)
        if f.fitted_at == seen:
            fits.append(seen)
    assert fits == list(range(24, 145, 12))


def test_planner_history_counts_intervals_closed_beyond_the_kept_history():
    planner = Planner(PlannerConfig(interval_s=1.0, season_s=12.0, history_seasons=2, cold_start_s=0.0), start=0.0)
    planner.on_arrival(0.5, 100)
    history = planner.snapshot(150.0)
    assert (len(history.tokens), history.closed, history.tokens[0]) == (24, 150, 0.0)
    assert planner.forecast(history) == Forecast(0.0, 0.0)
    fitted = []
    for now in (150.0, 161.0, 162.0):
        planner.forecast(planner.snapshot(now))
        fitted.append(planner._tokens_forecaster.fitted_at)
    assert fitted == [150, 150, 162]  # re-fit after a season (12 intervals) closed, the history full


def test_forecaster_with_too_few_points_for_the_quick_fit_fits_fully_instead_of_raising():
    """Season 6: the quick re-fit (heuristic initial state) needs 16 points; at 12 to 15 the
    optimized fit runs each time and forecasts the exact continuation of a periodic series;
    at 16 the quick re-fit is used again (the last optimized fit stays at 15)."""
    f = SeasonalForecaster(6)
    for n in range(12, 17):
        forecast = f.forecast([float(i % 6) for i in range(n)], 6)
        assert forecast.round(6).tolist() == [float((n + k) % 6) for k in range(6)]
        assert f.fitted_at == min(n, 15)


def step_load(t: np.ndarray) -> np.ndarray:
    """1,000 tokens/s, and 5,000 from 09:00 to 17:00 every day (tokens/s)."""
    hour = (t % DAY) / 3600
    return np.where((hour >= 9) & (hour < 17), 5000.0, 1000.0)


def first_time_at(planner: Planner, day: int, count: int, rng: np.random.Generator) -> float:
    """Runs the planner through ``day`` (after its history) with decisions every interval;
    returns the first time its desired count reaches ``count``."""
    start = day * DAY
    for i in range(288):
        now = start + i * INTERVAL
        planner.on_arrival(now, 0, 0)
        if planner.decide(now).desired >= count:
            return now
        feed(planner, step_load(np.array([now])), now, rng)
    raise AssertionError("never reached")


@pytest.mark.parametrize("cold_start_s", [900.0, 1800.0])
def test_desired_executors_lead_the_peak_by_the_cold_start(cold_start_s):
    """The load needs 3 executors from 09:00 (capacity 2,000 tokens/s at 100 %); with three
    days of history the predictive planner asks for 3 at least one cold start (and at most
    one more interval) before 09:00; the reactive one only after the load arrived."""
    config = PlannerConfig(interval_s=INTERVAL, season_s=DAY, capacity_tokens_per_s=2000.0, target_utilization=1.0,
                           cold_start_s=cold_start_s, max_executors=8, scale_down_cooldown_s=3600.0)
    for predictive in (True, False):
        rng = np.random.default_rng(3)
        planner = Planner(PlannerConfig(**{**config.__dict__, "predictive": predictive}))
        feed(planner, step_load(np.arange(3 * 288) * INTERVAL), 0.0, rng)
        planner.on_cold_start(cold_start_s - 100.0)  # measured: the largest measured one counts
        planner.on_cold_start(cold_start_s)
        t = first_time_at(planner, 3, 3, rng) - 3 * DAY
        peak = 9 * 3600.0
        if predictive:
            assert peak - cold_start_s - 2 * INTERVAL <= t <= peak - cold_start_s, t
            assert planner.last.lead_s == cold_start_s + INTERVAL
        else:
            assert t == peak + INTERVAL  # the first decision after the first loaded interval


def test_capacity_is_measured_in_saturated_intervals():
    planner = Planner(PlannerConfig(interval_s=10.0, season_s=100.0, capacity_tokens_per_s=999.0))
    assert planner.capacity_tokens_per_s == 999.0
    planner.observe(0.0, 2, 0)
    planner.on_served(1.0, 4000)  # not saturated: no sample
    planner.observe(10.0, 2, 3)
    planner.on_served(15.0, 6000)  # saturated with 2 executors: 6000 / (10 s * 2)
    planner.decide(20.0)
    assert planner.capacity_tokens_per_s == 300.0
    planner.observe(21.0, 2, 5)  # saturated, but nothing finished in it: no sample (never a capacity of 0)
    assert planner.decide(30.0).capacity_tokens_per_s == 300.0
    planner.observe(31.0, 2, 1)  # a request waited a moment, then was dispatched: not saturated throughout
    planner.observe(32.0, 2, 0)
    planner.on_served(35.0, 500)  # bounded by the arrivals, not by capacity: no sample
    assert planner.decide(40.0).capacity_tokens_per_s == 300.0


def run_c43(loads: list[tuple[float, float]], until: float):
    """Decisions every 5 s on a fake clock; ``loads``: (from time, tokens/s) steps; capacity
    100 tokens/s per executor at 100 %, cooldown 30 s. Returns [(time, desired)]."""
    planner = Planner(PlannerConfig(interval_s=5.0, season_s=3600.0, capacity_tokens_per_s=100.0,
                                    target_utilization=1.0, min_executors=0, max_executors=8,
                                    scale_down_cooldown_s=30.0, predictive=False))
    out = []
    t = 0.0
    while t <= until:
        load = [v for start, v in loads if start <= t][-1]
        out.append((t, planner.decide(t).desired))
        planner.on_arrival(t, int(load * 5.0), 1)
        t += 5.0
    return out


def changes(trace):
    return [(t, b - a) for (_, a), (t, b) in zip(trace, trace[1:]) if a != b]


def test_alternating_load_does_not_flap():
    """C43: load alternating around the threshold every 10 s for 180 s: no two scale-downs
    within 30 s, at most 6 in all, no up-then-down within 30 s, scale-ups within one interval."""
    loads = [(float(s), 250.0 if (s // 10) % 2 == 0 else 150.0) for s in range(0, 185, 10)]
    trace = run_c43(loads, 180.0)
    downs = [t for t, d in changes(trace) if d < 0]
    ups = [t for t, d in changes(trace) if d > 0]
    assert len(downs) <= 6
    assert all(b - a >= 30.0 for a, b in zip(downs, downs[1:]))
    assert not any(0 < d - u < 30.0 for u in ups for d in downs)
    assert ups[0] == 5.0  # the first decision after the first interval with load


def test_scale_down_steps_one_per_cooldown_after_the_load_fell():
    """C43: load that needs 4 executors falls to what needs 1 at t=60 s, then to 0 at 200 s:
    4→3→2→1 at 30 s intervals from the first decision that saw it, then 1→0 30 s after 200 s."""
    trace = run_c43([(0.0, 400.0), (60.0, 100.0), (200.0, 0.0)], 300.0)
    assert [(t, d) for t, d in changes(trace)] == [(5.0, 4), (95.0, -1), (125.0, -1), (155.0, -1), (235.0, -1)]


def test_the_planner_loop_decides_on_the_reactive_floor_when_the_forecast_fails(caplog):
    """A forecast that raises does not stop the decision: each tick decides without it
    (predictive None; 250 tokens/s last interval at 100 tokens/s per executor: 3), and
    each kind of error is logged once, not on every tick."""
    import asyncio
    import logging

    from scheduler.admission import AdmissionCore
    from scheduler.config import SchedulerConfig
    from scheduler.planner_loop import PlannerLoop

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    planner = Planner(PlannerConfig(interval_s=1.0, season_s=12.0, min_executors=0, max_executors=4,
                                    capacity_tokens_per_s=100.0, target_utilization=1.0), start=0.0)
    errors = [ValueError("bad fit"), ValueError("bad fit"), np.linalg.LinAlgError("singular")]

    def failing_forecast(history):
        raise errors.pop(0)

    planner.forecast = failing_forecast
    loop = PlannerLoop(planner, AdmissionCore(SchedulerConfig()), clock=clock)
    decisions = []
    with caplog.at_level(logging.WARNING, logger="scheduler.planner_loop"):
        for t in (1.0, 2.0, 3.0):
            planner.on_arrival(t - 0.5, 250)
            clock.t = t
            decision = asyncio.run(loop.tick())
            decisions.append((decision.desired, decision.predictive, decision.reactive))
    assert decisions == [(3, None, 3)] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "planner forecast failed (ValueError: bad fit); deciding on the reactive floor alone, "
        "further ValueError failures not logged",
        "planner forecast failed (LinAlgError: singular); deciding on the reactive floor alone, "
        "further LinAlgError failures not logged"]


def test_a_non_finite_or_negative_cold_start_is_ignored_and_decisions_go_on():
    """A registration reporting an infinite, NaN or negative start time leaves the cold start
    planned for at the configured 60 s (lead 120 s, 2 intervals); a finite one is used."""
    planner = Planner(PlannerConfig(interval_s=60.0, season_s=3600.0, min_executors=0, max_executors=4), start=0.0)
    for seconds in (math.inf, -math.inf, math.nan, -1.0):
        planner.on_cold_start(seconds)
    decision = planner.decide(61.0)
    steps = planner.snapshot(61.0).steps
    assert (decision.desired, decision.cold_start_s, decision.lead_s, steps) == (0, 60.0, 120.0, 2)
    planner.on_cold_start(45.0)
    assert (planner.decide(122.0).cold_start_s, planner.snapshot(122.0).steps) == (45.0, 2)
