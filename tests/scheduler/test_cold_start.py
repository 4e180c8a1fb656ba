"""Cold starts against scale-to-zero (case C44) on a fake clock, without gRPC or processes.

The real planner (``scheduler.planner``), admission core (``scheduler.admission``,
with a start budget) and the launcher's decisions (``meshserve.cli.autoscale``:
``plan``, ``overdue``) run one step per simulated second; what is simulated is
only the executor processes themselves: one started at ``t`` registers (is
ready) at ``t + start_s``. That lets the case's 20–60 s times run in
milliseconds."""

from dataclasses import dataclass, field

import pytest

from gateway.http.errors import http_error
from meshserve.cli.autoscale import overdue, plan
from meshserve.errors import InvalidArgument, Unavailable
from scheduler.admission import AdmissionCore
from scheduler.admission_queue import AdmissionRequest
from scheduler.config import SchedulerConfig
from scheduler.planner import Planner, PlannerConfig
from scheduler.registry import ExecutorState

IDLE_S = 20.0  # the idle window (the planner's scale-down cooldown)
CAPACITY = 100.0  # tokens/s of one executor, planned at 100 %


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def request(rid: str, prompt: int = 20, max_tokens: int = 8) -> AdmissionRequest:
    return AdmissionRequest(rid, "t", 0, prompt, max_tokens, "m")


def state(name: str) -> ExecutorState:
    return ExecutorState(name, f"addr-{name}", "m", 64, 16, 1024)


@dataclass
class ColdStartMesh:
    """The scheduler's core and planner and the launcher's decisions, stepped once per
    second; executors become ready ``start_s`` after their start (a tuple: one per
    start in order, the last for every later one)."""

    start_s: float | tuple[float, ...]
    start_budget_s: float
    low: int = 0
    high: int = 4
    clock: Clock = field(default_factory=Clock)
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (time, kind, executor)
    running: list[str] = field(default_factory=list)  # started and not drained, oldest first
    starting: dict[str, float] = field(default_factory=dict)  # name -> start time
    ready_at: dict[str, float] = field(default_factory=dict)  # name -> when it will be ready
    assigned: dict[str, tuple[float, str]] = field(default_factory=dict)  # request -> (time, executor)
    failed: dict[str, tuple[float, Exception]] = field(default_factory=dict)  # request -> (time, error)
    trace: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, desired, ready, raw)

    def __post_init__(self):
        self.core = AdmissionCore(SchedulerConfig(start_budget_s=self.start_budget_s), clock=self.clock)
        self.planner = Planner(PlannerConfig(interval_s=1.0, season_s=3600.0, min_executors=self.low,
                                             max_executors=self.high, capacity_tokens_per_s=CAPACITY,
                                             target_utilization=1.0, scale_down_cooldown_s=IDLE_S,
                                             predictive=False))
        self._n = 0
        self._delays = list(self.start_s) if isinstance(self.start_s, tuple) else [self.start_s]

    def ready(self) -> int:
        return sum(1 for e in self.core.registry if not e.draining)

    def start_ready(self, count: int) -> None:
        """``count`` executors that are ready already (started long ago)."""
        for _ in range(count):
            name = f"executor-{self._n}"
            self._n += 1
            self.running.append(name)
            self.core.registry.add(state(name))

    def submit(self, rid: str, prompt: int = 20) -> None:
        req = request(rid, prompt)
        self.core.submit(req)
        self.planner.on_arrival(self.clock(), int(req.cost))

    def step(self, load_tokens: int = 0) -> None:
        """One second: readiness, start budgets, expired waits, dispatch, a decision and
        the launcher's starts and drains; ``load_tokens`` arrive (and are served) in it."""
        now = self.clock()
        for name in list(self.starting):
            if now >= self.ready_at[name]:
                del self.starting[name]
                self.core.registry.add(state(name))
                self.events.append((now, "ready", name))
        for name in overdue(self.starting, now, self.start_budget_s):
            del self.starting[name]
            self.running.remove(name)
            self.events.append((now, "failed", name))
        for req, exc in self.core.expire_start_waits():
            self.failed[req.request_id] = (now, exc)
        for req, lease in self.core.dispatch():
            self.assigned[req.request_id] = (now, lease.executor_id)
        if load_tokens:
            self.planner.on_arrival(now, load_tokens)
        self.planner.observe(now, self.ready(), len(self.core))
        decision = self.planner.decide(now, sum(r.queued_tokens for r in self.core.queued()))
        self.trace.append((now, decision.desired, self.ready(), decision.raw))
        to_start, to_drain = plan(decision.desired, self.running, self.low, self.high, self.starting)
        for _ in range(to_start):
            name = f"executor-{self._n}"
            self._n += 1
            self.running.append(name)
            self.starting[name] = now
            self.ready_at[name] = now + (self._delays.pop(0) if len(self._delays) > 1 else self._delays[0])
            self.events.append((now, "start", name))
        for name in to_drain:
            self.running.remove(name)
            if self.starting.pop(name, None) is None:
                self.core.remove_executor(name)
            self.events.append((now, "drain", name))
        self.clock.t += 1.0

    def run_until(self, t: float, load_tokens: int = 0) -> None:
        while self.clock() <= t:
            self.step(load_tokens)


def test_a_request_at_zero_executors_waits_for_the_one_it_starts():
    """C44: idle window 20 s, executor start 40 s, 0 executors, one request at t = 0: the
    planner asks for an executor at once (the waiting request is queued load), the request
    is assigned the moment it is ready (40 s, within start + 10 s), the executor is not
    removed before it is ready, and leaves one idle window after its readiness (60 s)."""
    mesh = ColdStartMesh(start_s=40.0, start_budget_s=300.0)
    mesh.submit("r")  # not refused: it waits for an executor
    assert len(mesh.core) == 1
    mesh.run_until(80.0)
    assert mesh.assigned == {"r": (40.0, "executor-0")}
    assert mesh.events == [(0.0, "start", "executor-0"), (40.0, "ready", "executor-0"),
                           (60.0, "drain", "executor-0")]
    assert mesh.failed == {}


def test_the_idle_timer_starts_at_readiness_even_when_nothing_waits():
    """C44: the request's caller goes away at 5 s, long before the 40 s start; the executor
    started for it is still not given up before it is ready: the idle window of 20 s runs
    from its readiness (40 s), so it is drained at 60 s, not at 22 s."""
    mesh = ColdStartMesh(start_s=40.0, start_budget_s=300.0)
    mesh.submit("r")
    mesh.run_until(4.0)
    assert mesh.core.cancel("r")
    mesh.run_until(80.0)
    assert mesh.events == [(0.0, "start", "executor-0"), (40.0, "ready", "executor-0"),
                           (60.0, "drain", "executor-0")]
    assert [d for t, d, _, _ in mesh.trace if 1.0 <= t < 60.0] == [1] * 59
    assert mesh.assigned == {}


def test_an_executor_over_the_start_budget_is_failed_and_replaced_and_the_request_gets_503():
    """C44: start budget 30 s, start 60 s: the request ends with UNAVAILABLE at 30 s (HTTP
    503 with Retry-After), not a hang; the executor is declared failed at 30 s and a
    replacement started at the same step."""
    mesh = ColdStartMesh(start_s=60.0, start_budget_s=30.0)
    mesh.submit("r")
    mesh.run_until(29.0)
    assert mesh.failed == {} and len(mesh.core) == 1
    mesh.run_until(30.0)
    when, exc = mesh.failed["r"]
    assert when == 30.0 and isinstance(exc, Unavailable) and "start budget of 30 s" in str(exc)
    assert len(mesh.core) == 0 and mesh.assigned == {}
    assert mesh.events == [(0.0, "start", "executor-0"), (30.0, "failed", "executor-0"),
                           (30.0, "start", "executor-1")]
    error = http_error(exc).response()
    assert error.status_code == 503 and error.headers["retry-after"] == "1"


def test_scale_down_removes_the_starting_executor_first_and_keeps_ready_above_demand():
    """C44: 3 executors (2 ready, 1 starting) while the load falls to what 1 can serve: the
    first step down (one idle window after the fall) drains the starting executor, the
    second a ready one; the ready count never drops below the demand (raw count)."""
    mesh = ColdStartMesh(start_s=(5.0, 40.0), start_budget_s=300.0, low=1)
    mesh.start_ready(1)
    mesh.run_until(9.0, load_tokens=150)  # needs 2: executor-1 starts at 1 s, ready at 6 s
    mesh.run_until(10.0, load_tokens=250)  # needs 3: executor-2 starts at 11 s (ready at 51 s)
    mesh.run_until(90.0, load_tokens=80)  # from 11 s: what one executor serves
    assert mesh.events == [(1.0, "start", "executor-1"), (6.0, "ready", "executor-1"),
                           (11.0, "start", "executor-2"), (32.0, "drain", "executor-2"),
                           (52.0, "drain", "executor-1")]
    assert [(d, ready) for t, d, ready, _ in mesh.trace if t == 31.0] == [(3, 2)]  # 2 ready, 1 starting
    after_fall = [(ready, raw) for t, _, ready, raw in mesh.trace if t >= 12.0]
    assert all(ready >= raw == 1 for ready, raw in after_fall) and after_fall[-1] == (1, 1)
    assert mesh.running == ["executor-0"]


def test_plan_drains_starting_executors_before_ready_ones():
    running = ["executor-0", "executor-1", "executor-2", "executor-3"]
    assert plan(2, running, 1, 4, starting={"executor-1"}) == (0, ["executor-1", "executor-3"])
    assert plan(3, running, 1, 4) == (0, ["executor-3"])
    assert overdue({"a": 0.0, "b": 5.0}, 30.0, 30.0) == ["a"]


def test_a_waiting_request_the_executor_cannot_hold_is_refused_when_it_registers():
    """Scale to zero: a request queued with no executor is checked when one registers:
    a prompt longer than its cache is INVALID_ARGUMENT then, not a wait for ever."""
    clock = Clock()
    core = AdmissionCore(SchedulerConfig(start_budget_s=30.0), clock=clock)
    core.submit(request("long", prompt=2000))
    core.submit(request("short"))
    assert core.expire_start_waits() == []
    core.registry.add(state("e0"))  # 64 blocks of 16: 1023 prompt tokens at most
    (req, exc), = core.expire_start_waits()
    assert req.request_id == "long" and isinstance(exc, InvalidArgument) and "1023 prompt tokens" in str(exc)
    assert [r.request_id for r, _ in core.dispatch()] == ["short"]


def test_without_a_start_budget_no_executor_is_unavailable_at_once():
    core = AdmissionCore(SchedulerConfig())
    with pytest.raises(Unavailable, match="no executor"):
        core.submit(request("r"))


def test_a_request_queued_at_zero_wakes_the_planner_before_its_interval():
    """C44 (found by a fresh user of `up --autoscale 0..2`: with the default 60 s
    interval a cold request first waited for the planner's next decision, so a start
    budget under the interval plus the start always ran out): a request queued while
    no executor is ready makes the planner want one at the next observation, not at
    the next interval; the interval's own decision then keeps it while it starts."""
    import asyncio

    from scheduler.planner_loop import PlannerLoop

    clock = Clock(0.0)
    core = AdmissionCore(SchedulerConfig(start_budget_s=300.0), clock=clock)
    planner = Planner(PlannerConfig(interval_s=60.0, season_s=3600.0, min_executors=0, max_executors=2,
                                    capacity_tokens_per_s=CAPACITY, predictive=False), start=0.0)
    loop = PlannerLoop(planner, core, clock=clock)
    assert asyncio.run(loop.tick()).desired == 0
    clock.t = 1.0
    loop.observe()                                    # nothing queued: nothing wanted
    assert planner.desired == 0
    core.submit(request("r"))
    loop.observe()                                    # as the servicer does after each dispatch
    assert (planner.desired, planner.last.desired) == (1, 1)
    clock.t = 60.0
    assert asyncio.run(loop.tick()).desired == 1      # still queued, nothing ready: kept
    core.registry.add(state("executor-0"))
    assert [lease.executor_id for _, lease in core.dispatch()] == ["executor-0"]


def test_wake_from_zero_changes_nothing_while_an_executor_is_ready_or_nothing_waits():
    planner = Planner(PlannerConfig(interval_s=60.0, season_s=3600.0, min_executors=0, max_executors=2,
                                    predictive=False), start=0.0)
    planner.observe(1.0, 1, 3)
    assert planner.wake_from_zero(1.0, 3) is None and planner.desired == 0
    planner.observe(2.0, 0, 0)
    assert planner.wake_from_zero(2.0, 0) is None and planner.desired == 0


def test_an_executor_that_never_becomes_ready_is_not_restarted_once_nothing_is_queued():
    """Start budget 30 s, every start 60 s: the request ends UNAVAILABLE at 30 s; starting
    executors are held for it (each failed one replaced) only while a request was queued
    within cold start + interval (last queued at 29 s, 60 + 1 s: until 90 s); the idle
    timer then runs and drains the last starting executor one window (20 s) later, at
    111 s: back to zero, no start after 90 s."""
    mesh = ColdStartMesh(start_s=60.0, start_budget_s=30.0)
    mesh.submit("r")
    mesh.run_until(600.0)
    assert {rid: (t, type(exc)) for rid, (t, exc) in mesh.failed.items()} == {"r": (30.0, Unavailable)}
    assert mesh.events == [(0.0, "start", "executor-0"), (30.0, "failed", "executor-0"),
                           (30.0, "start", "executor-1"), (60.0, "failed", "executor-1"),
                           (60.0, "start", "executor-2"), (90.0, "failed", "executor-2"),
                           (90.0, "start", "executor-3"), (111.0, "drain", "executor-3")]
    assert [t for t, d, _, _ in mesh.trace if d == 1] == [float(t) for t in range(0, 111)]
    assert mesh.running == [] and mesh.starting == {}


def test_the_idle_timer_is_held_for_a_starting_executor_only_while_requests_were_queued_lately():
    """The planner alone (interval 1 s, cold start 60 s, idle window 20 s): woken at 0 s, a
    request queued until 299 s and no executor ever ready. Desired stays 1 while requests
    wait and for cold start + interval after the last one (360 s), then the window runs:
    0 from 381 s."""
    planner = Planner(PlannerConfig(interval_s=1.0, season_s=3600.0, min_executors=0, max_executors=2,
                                    scale_down_cooldown_s=IDLE_S, predictive=False), start=0.0)
    planner.observe(0.0, 0, 1)
    assert planner.wake_from_zero(0.0, 1).desired == 1
    desired = {}
    for t in range(1, 601):
        planner.observe(float(t), 0, 1 if t < 300 else 0)
        desired[t] = planner.decide(float(t)).desired
    assert [t for t, d in desired.items() if d == 1] == list(range(1, 381))
    assert (planner.demand_recent(360.0), planner.demand_recent(361.0)) == (True, False)
