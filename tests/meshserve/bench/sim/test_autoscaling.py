"""The simulation loop under an autoscaler, and the diurnal workload (predictive vs reactive)."""

import pytest

from meshserve.bench.sim import autoscaling
from meshserve.bench.sim.loop import Fleet, Job, MeshSimConfig, simulate


class ScriptedScaler:
    """Wants ``counts[i]`` executors at the i-th tick (then the last count)."""

    def __init__(self, counts, tick_s=10.0, cold_start_s=5.0):
        self.counts, self.tick_s, self.cold_start_s = counts, tick_s, cold_start_s
        self.ticks = 0
        self.arrived = self.served = 0

    def on_arrival(self, now, num_tokens):
        self.arrived += 1

    def on_served(self, now, num_tokens):
        self.served += 1

    def target(self, now, num_ready, num_queued, queued_tokens):
        self.ticks += 1
        return self.counts[min(self.ticks, len(self.counts)) - 1]


def test_loop_adds_an_executor_after_its_cold_start_and_drains_one_without_losing_requests():
    cfg = MeshSimConfig(num_executors=1, num_blocks=64, max_num_seqs=4, step_base_s=0.5, step_per_token_s=0.0,
                        routing="least-loaded")
    jobs = [Job("t", 16, 40, [], arrival=float(i)) for i in range(30)]
    scaler, fleet = ScriptedScaler([2, 2, 1]), Fleet()
    reqs, executors, core = simulate(cfg, jobs, scaler=scaler, fleet=fleet)
    assert all(r.finished is not None and r.generated == 40 for r in reqs)  # nothing lost to the drain
    assert scaler.arrived == scaler.served == 30
    assert fleet.lives["e1"][:2] == [10.0, 15.0]  # asked at the first tick, registered a cold start later
    drained = [eid for eid, (_, _, gone) in fleet.lives.items() if gone is not None]
    assert len(drained) == 1 and drained[0] not in executors  # drained at the third tick, then gone
    served_there = [r for r in reqs if r.executor_id == drained[0]]
    assert served_there and max(r.finished for r in served_there) <= fleet.lives[drained[0]][2]
    assert all(r.assigned < 30.0 for r in served_there)  # nothing new went there after the drain (t = 30)
    assert fleet.cold_starts(0.0, 100.0) == 1
    assert len(core.registry) == 1


SMALL = autoscaling.DiurnalSimConfig(days=3, day_s=1200.0, interval_s=20.0, cold_start_s=60.0,
                                     scale_down_cooldown_s=60.0, peak_rate=8.0, bursts_per_day=1.0)


@pytest.fixture(scope="module")
def small_report():
    """``compare(SMALL)``: both autoscalers on the same trace, simulated once for the module."""
    return autoscaling.compare(SMALL)


def test_diurnal_report_has_its_keys_and_is_deterministic(small_report):
    report = small_report
    assert {"slo_violations", "executor_hours", "cold_starts", "slo_violations_ratio",
            "executor_hours_ratio"} <= set(report)
    again = autoscaling.compare(SMALL)
    assert (report["slo_violations"], report["executor_hours"], report["cold_starts"]) == \
        (again["slo_violations"], again["executor_hours"], again["cold_starts"])
    assert report["series_by_autoscaler"] == again["series_by_autoscaler"]
    assert report["baseline"]["autoscaler"] == "reactive"
    assert report["requests_scored"] == report["baseline"]["requests_scored"] > 0  # the same trace


def test_predictive_starts_executors_before_reactive_on_the_same_trace(small_report):
    """On the scored day the predictive planner reaches its peak count no later than the
    reactive one and violates the SLO less often (both runs of ``compare``: the same
    measured capacity and trace)."""
    assert small_report["autoscaler"] == "predictive"
    series = small_report["series_by_autoscaler"]

    def first_at_peak(s):
        top = max(s["desired"])
        return next(t for t, d in zip(s["time_s"], s["desired"]) if t >= 2 * SMALL.day_s and d == top)

    assert first_at_peak(series["predictive"]) < first_at_peak(series["reactive"])
    assert small_report["slo_violations"] < small_report["baseline"]["slo_violations"]
