"""Workload ``diurnal``: the predictive planner against a reactive autoscaler.

The executors and scheduler are ``meshserve.bench.sim.loop``'s (the real
``AdmissionCore``), with an autoscaler (``loop.Scaler``) that is the real
``scheduler.planner.Planner``: ``predictive`` (Holt-Winters forecast led by the
cold start, reactive floor) or ``reactive`` (the same planner with the
forecast off: the floor alone). Same seeded trace, same settings otherwise.

* **Time is compressed**: one simulated "day" lasts ``day_s`` seconds (default
  3,600: one hour), so a multi-day trace runs in seconds of CPU; the planner's
  interval, the executors' cold start and the cooldown are set in the same
  compressed seconds (defaults: interval 30 s, cold start 90 s, i.e. 2.5 % of a
  day, about 36 real minutes: a slow node start plus model load).
* **Trace** (``arrival_rate``): ``peak_rate`` × daily shape (``night_level`` at
  night, a bell around ``peak_hour``) × weekly shape (days 5 and 6 of every
  week at ``weekend_level``) × noise (a log-normal factor per planner interval,
  σ ``noise_sigma``) × bursts (``bursts_per_day`` at random times, each
  ``burst_s`` long at ``burst_factor``); arrivals are a non-homogeneous Poisson
  process of that rate (thinning). Prompt and output lengths are log-normal.
* **Scoring**: the first ``warmup_days`` train the forecaster (it needs two
  seasons); both autoscalers are scored on the days after: a request violates
  the SLO when its TTFT exceeds ``slo_ttft_s``; executor-hours count every
  executor from the moment it is asked for (cold start included) until it has
  drained, in simulated seconds / 3,600; cold starts count executors asked for.

The capacity of one executor (tokens/s) is measured first, as the planner
measures it in service: a saturated run of the same request mix on one
executor (``measure_capacity``).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace

from meshserve.bench.sim.loop import Fleet, Job, MeshSimConfig, simulate
from meshserve.bench.stats import percentile
from scheduler.planner import Planner, PlannerConfig

AUTOSCALERS = ("predictive", "reactive")


@dataclass(frozen=True)
class DiurnalSimConfig:
    """Trace, executors and autoscaler of the simulation (compressed seconds)."""

    autoscaler: str = "predictive"
    seed: int = 0
    days: int = 9
    warmup_days: int = 2
    day_s: float = 3600.0
    peak_rate: float = 16.0  # requests/s at the daily peak
    night_level: float = 0.15
    peak_hour: float = 14.0
    peak_width_h: float = 4.0
    weekend_level: float = 0.6
    noise_sigma: float = 0.1
    bursts_per_day: float = 2.0
    burst_s: float = 60.0
    burst_factor: float = 1.5
    prompt_median: int = 200
    output_median: int = 24
    slo_ttft_s: float = 2.0
    interval_s: float = 30.0
    cold_start_s: float = 90.0
    scale_down_cooldown_s: float = 120.0
    target_utilization: float = 0.75
    min_executors: int = 1
    max_executors: int = 16
    mesh: MeshSimConfig = field(default_factory=lambda: MeshSimConfig(
        num_executors=1, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=1024, step_base_s=0.1,
        step_per_token_s=0.0004, queue_policy="fcfs", routing="least-loaded"))


def arrival_rate(cfg: DiurnalSimConfig, t: float, noise: dict[int, float], bursts: list[float]) -> float:
    """Requests/s at time ``t`` (seconds): daily × weekly shape × interval noise × bursts."""
    day, within = divmod(t, cfg.day_s)
    hour = 24.0 * within / cfg.day_s
    daily = cfg.night_level + (1 - cfg.night_level) * math.exp(-((hour - cfg.peak_hour) / cfg.peak_width_h) ** 2)
    weekly = cfg.weekend_level if int(day) % 7 in (5, 6) else 1.0
    burst = cfg.burst_factor if any(b <= t < b + cfg.burst_s for b in bursts) else 1.0
    return cfg.peak_rate * daily * weekly * noise.get(int(t // cfg.interval_s), 1.0) * burst


def workload(cfg: DiurnalSimConfig) -> list[Job]:
    """The seeded jobs of ``cfg.days`` days (thinning of a Poisson process at the peak bound)."""
    rng = random.Random(cfg.seed)
    end = cfg.days * cfg.day_s
    noise = {i: math.exp(rng.gauss(0.0, cfg.noise_sigma)) for i in range(int(end // cfg.interval_s) + 1)}
    bursts = sorted(rng.uniform(0, end) for _ in range(round(cfg.bursts_per_day * cfg.days)))
    bound = cfg.peak_rate * cfg.burst_factor * math.exp(4 * cfg.noise_sigma)
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(bound)
        if t >= end:
            return jobs
        if rng.random() * bound < arrival_rate(cfg, t, noise, bursts):
            prompt = min(2000, max(8, round(cfg.prompt_median * math.exp(rng.gauss(0, 0.5)))))
            output = min(512, max(1, round(cfg.output_median * math.exp(rng.gauss(0, 0.5)))))
            jobs.append(Job("t0", prompt, output, [], arrival=t, max_tokens=output))


def measure_capacity(cfg: DiurnalSimConfig, num_jobs: int = 400) -> float:
    """Tokens/s (prompt + output) one executor serves saturated, on this request mix."""
    jobs = [replace(j, arrival=0.0) for j in workload(replace(cfg, days=1))[:num_jobs]]
    reqs, _, _ = simulate(replace(cfg.mesh, num_executors=1), jobs)
    return sum(r.prompt + r.output for r in reqs) / max(r.finished for r in reqs)


class PlannerScaler:
    """``loop.Scaler`` over the scheduler's ``Planner``."""

    def __init__(self, planner: Planner, cold_start_s: float):
        self.planner = planner
        self.tick_s = planner.config.interval_s
        self.cold_start_s = cold_start_s
        self.decisions: list[tuple[float, int]] = []  # (time, desired)
        planner.on_cold_start(cold_start_s)  # measured at every registration in service

    def on_arrival(self, now: float, num_tokens: int) -> None:
        self.planner.on_arrival(now, num_tokens)

    def on_served(self, now: float, num_tokens: int) -> None:
        self.planner.on_served(now, num_tokens)

    def target(self, now: float, num_ready: int, num_queued: int, queued_tokens: int) -> int:
        self.planner.observe(now, num_ready, num_queued)
        desired = self.planner.decide(now, queued_tokens).desired
        self.decisions.append((now, desired))
        return desired


def run(cfg: DiurnalSimConfig, capacity_tokens_per_s: float | None = None) -> dict:
    """One autoscaler on the trace; the report (module docstring for the keys' meaning)."""
    if cfg.autoscaler not in AUTOSCALERS:
        raise ValueError(f"unknown autoscaler {cfg.autoscaler!r} (choose from {', '.join(AUTOSCALERS)})")
    capacity = capacity_tokens_per_s or measure_capacity(cfg)
    planner = Planner(PlannerConfig(
        interval_s=cfg.interval_s, season_s=cfg.day_s, min_executors=cfg.min_executors,
        max_executors=cfg.max_executors, capacity_tokens_per_s=capacity, cold_start_s=cfg.cold_start_s,
        target_utilization=cfg.target_utilization, scale_down_cooldown_s=cfg.scale_down_cooldown_s,
        predictive=cfg.autoscaler == "predictive"))
    scaler = PlannerScaler(planner, cfg.cold_start_s)
    fleet = Fleet()
    jobs = workload(cfg)
    reqs, _, _ = simulate(replace(cfg.mesh, num_executors=cfg.min_executors), jobs, scaler=scaler, fleet=fleet)
    start, end = cfg.warmup_days * cfg.day_s, cfg.days * cfg.day_s
    scored = [r for r in reqs if start <= r.arrival < end]
    times = [t for t, _ in scaler.decisions]
    arrivals = [0] * len(times)
    for r in reqs:
        arrivals[min(len(times) - 1, int(r.arrival // cfg.interval_s))] += 1
    ttft = [r.first_token - r.arrival for r in scored]
    violations = sum(t > cfg.slo_ttft_s for t in ttft)
    return {
        "autoscaler": cfg.autoscaler,
        "slo_violations": violations,
        "slo_violation_rate": violations / max(1, len(scored)),
        "executor_hours": fleet.executor_seconds(start, end) / 3600.0,
        "cold_starts": fleet.cold_starts(start, end),
        "requests_scored": len(scored),
        "requests_total": len(reqs),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "capacity_tokens_per_s": capacity,
        "max_executors_desired": max(d for _, d in scaler.decisions),
        "series": {"time_s": times, "arrival_rate": [n / cfg.interval_s for n in arrivals],
                   "desired": [d for _, d in scaler.decisions],
                   "ready": [sum(ready is not None and ready <= t and (gone is None or gone > t)
                                 for _asked, ready, gone in fleet.lives.values()) for t in times]},
        "config": {k: v for k, v in asdict(cfg).items() if k != "mesh"} | {"mesh": asdict(cfg.mesh)},
    }


def compare(cfg: DiurnalSimConfig) -> dict:
    """Both autoscalers on the same seeded trace and capacity; ratios predictive / reactive."""
    capacity = measure_capacity(cfg)
    runs = {name: run(replace(cfg, autoscaler=name), capacity) for name in AUTOSCALERS}
    p, r = runs["predictive"], runs["reactive"]
    other = AUTOSCALERS[1 - AUTOSCALERS.index(cfg.autoscaler)]
    return {**runs[cfg.autoscaler],
            "baseline": {k: v for k, v in runs[other].items() if k not in ("series", "config")},
            "slo_violations_ratio": p["slo_violations"] / max(1, r["slo_violations"]),
            "executor_hours_ratio": p["executor_hours"] / r["executor_hours"],
            "series_by_autoscaler": {name: run_["series"] for name, run_ in runs.items()}}


def plot(report: dict, path: str) -> None:
    """Arrival rate and ready executors over time, predictive against reactive (PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series_by_autoscaler"]
    day_s = report["config"]["day_s"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    s = series["predictive"]
    days = [t / day_s for t in s["time_s"]]
    top.plot(days, s["arrival_rate"], color="grey", lw=0.6)
    top.set_ylabel("arrivals (requests/s)")
    for name, color in (("reactive", "tab:orange"), ("predictive", "tab:blue")):
        x = [t / day_s for t in series[name]["time_s"]]
        bottom.step(x, series[name]["ready"], where="post", color=color, lw=0.8, label=f"{name}: ready executors")
    bottom.axvline(report["config"]["warmup_days"], color="black", ls=":", lw=0.8)
    bottom.set_xlabel("day (compressed: one day = %.0f s)" % day_s)
    bottom.set_ylabel("executors")
    bottom.legend(loc="upper left")
    fig.suptitle(f"predictive vs reactive autoscaling, same seeded trace: SLO violations x"
                 f"{report['slo_violations_ratio']:.2f}, executor-hours x{report['executor_hours_ratio']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
