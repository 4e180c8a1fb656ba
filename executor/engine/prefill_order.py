"""Short prefills first: the order in which a step takes its prefills.

Every request of a step waits for the whole step, so a short prefill (a
prefix-cache hit's uncached tail, a short prompt) beside a long one gets its first
token as late as the long one. With ``BatchSchedulerConfig.short_prefill_tokens``
= S > 0, ``BatchScheduler`` picks a step's prefills in two passes:

1. ``shorts_only(S, passed)``: the prefills with at most S tokens left to compute;
   the longer ones it passes over are listed in ``passed``;
2. ``the_rest(S, short_priority, passed)``: the others, where a longer prefill of no
   higher priority than the short ones taken sits out the step (and joins ``passed``).

``count_sit_outs`` then charges the step to every passed-over prefill that did not
run, whatever kept it out (a short one's tokens, its blocks, the budget), so a
prefill is passed over at most ``MAX_PREFILL_DEFERRALS`` steps over its life; then
the first pass takes it (running) or ends at it (waiting).

A short request never passes a prefill of higher priority, nor a waiting one that
has sat out its steps (it may be waiting for free blocks, which short ones must
not take first). This is shortest-remaining-processing-time order (Schrage, 1968)
at the granularity of a step: the short prefill gets a short step, the long one
waits a few short steps. Decodes are not prefills and always run first.

Shortest prompts first (``BatchSchedulerConfig.prefill_order`` = "shortest"):
both passes visit the waiting requests in ``shortest_first`` order instead of
arrival order: within a priority, the fewest tokens to compute first (less what
the prefix cache holds and the kvstore can load). When more prompts wait than
one step's budget holds (a burst), the step then completes as many prompts as
fit, and every prompt it completes gets its first token a whole step sooner; the
long prompts, which wait a step longer, would have waited most of it anyway. ``count_passed_by_later`` charges a waiting request each step a
later arrival of no higher priority went before it, so it too waits at most
``MAX_PREFILL_DEFERRALS`` steps; then it, and a preempted request, go first in
arrival order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from executor.engine.request import Request, RequestStatus

MAX_PREFILL_DEFERRALS = 4  # steps a long prefill may sit out for short ones, over its life
SHORTEST_FIRST_WINDOW = 512  # waiting requests shortest_first sorts (priority, then arrival order); the rest follow

# (request, tokens it has left to compute) -> True: take it; False: pass it over;
# None: end the pass over the waiting requests there (a running one is passed over).
Admit = Callable[[Request, int], "bool | None"]


def shorts_only(limit: int, passed: list[Request]) -> Admit:
    """The first pass: takes prefills of at most ``limit`` tokens left, and a running
    one that has sat out ``MAX_PREFILL_DEFERRALS`` steps; passes over (and appends to
    ``passed``) the other longer ones. A long waiting request that has sat out its
    steps, or a short one behind a passed-over prefill of higher priority, ends the
    pass over the waiting requests."""

    def admit(request: Request, num_left: int) -> bool | None:
        if num_left > limit:
            running = request.status == RequestStatus.RUNNING
            if request.num_prefill_deferrals >= MAX_PREFILL_DEFERRALS:
                if not running:
                    return None
                # it goes first, unless that would pass a prefill of higher priority
                return not any(p.priority > request.priority for p in passed)
            passed.append(request)
            return False
        return None if any(p.priority > request.priority for p in passed) else True
    return admit


def the_rest(limit: int, short_priority: int | None, passed: list[Request]) -> Admit:
    """The second pass: takes every prefill but a longer one of no higher priority than
    ``short_priority`` (the highest of the short prefills the first pass took; None:
    it took none, and nothing sits out); a short waiting request behind one that sits
    out with a higher priority ends the pass."""
    sat_out: list[int] = []  # priorities of the waiting requests sitting out

    def admit(request: Request, num_left: int) -> bool | None:
        if sits_out(request, num_left, limit, short_priority):
            passed.append(request)  # counted by count_sit_outs like the first pass's
            if request.status != RequestStatus.RUNNING:
                sat_out.append(request.priority)
            return False
        if num_left <= limit and sat_out and request.priority < max(sat_out):
            return None
        return True
    return admit


def sits_out(request: Request, num_left: int, limit: int, short_priority: int | None) -> bool:
    """Whether a prefill skips this step in the second pass.

    Args:
        request: the running or waiting request.
        num_left: its tokens left to compute (after any prefix-cache hit).
        limit: ``short_prefill_tokens``.
        short_priority: the highest priority of the short prefills the first pass took
            (None: it took none, and nothing sits out).
    """
    return not (short_priority is None or num_left <= limit or request.priority > short_priority
                or request.num_prefill_deferrals >= MAX_PREFILL_DEFERRALS)


def count_sit_outs(passed: Iterable[Request], scheduled: dict[str, int], short_priority: int | None) -> set[str]:
    """Charges the step to each prefill the first pass passed over that did not run
    (``scheduled``: request id -> tokens this step) when short ones of no lower
    priority ran (``short_priority``), towards its ``MAX_PREFILL_DEFERRALS``.

    Returns:
        The ids of the requests it charged.
    """
    charged: set[str] = set()
    if short_priority is None:
        return charged
    for request in {r.request_id: r for r in passed}.values():
        if request.request_id not in scheduled and request.priority <= short_priority:
            request.num_prefill_deferrals += 1
            charged.add(request.request_id)
    return charged


def goes_first(request: Request) -> bool:
    """A waiting request that ``shortest_first`` puts ahead of its priority's others:
    one preempted (it ran already), or one passed over ``MAX_PREFILL_DEFERRALS`` steps."""
    return request.num_preemptions > 0 or request.num_prefill_deferrals >= MAX_PREFILL_DEFERRALS


def shortest_first(waiting: Sequence[Request], num_cached: Callable[[Request], int] = lambda r: 0,
                   window: int = SHORTEST_FIRST_WINDOW) -> list[Request]:
    """The order "shortest" visits the waiting requests in: higher priority first; within
    a priority those that ``goes_first`` in arrival order, then the others by tokens to
    compute (``Request.num_tokens``, prompt plus any output of a preempted one, less
    ``num_cached``: its prefix-cache hit), fewest first, ties in arrival order.

    Only the first ``window`` requests of ``waiting`` are sorted (a step of
    ``max_num_seqs`` requests takes from them; the sort costs about a microsecond a
    request on a CPU core); those after follow in ``waiting``'s order.

    Args:
        waiting: ``BatchScheduler.waiting`` (sorted by ``Request.sort_key``).
        num_cached: a request's tokens it will not compute: in the prefix cache now or
            loadable from the kvstore (``BatchScheduler._num_cached_or_loadable``;
            default: none).
        window: how many to sort.

    Returns:
        A new list; ``waiting`` is not changed.
    """
    if len(waiting) < 2:
        return list(waiting)

    def key(request: Request) -> tuple[int, int, int, int]:
        if goes_first(request):
            return -request.priority, 0, 0, request.arrival
        return -request.priority, 1, request.num_tokens - num_cached(request), request.arrival
    return sorted(waiting[:window], key=key) + list(waiting[window:])


def insert_preempted(order: list[Request], request: Request) -> None:
    """Puts ``request``, preempted while the step is being built, into the step's
    ``shortest_first`` ``order`` where that order puts it (it ``goes_first``): after the
    requests of higher priority and those of its own that go first and arrived earlier,
    before the rest. Without it a later, shorter request of its priority could take the
    blocks it just freed in the same step, a pass no deferral counts."""
    for index, other in enumerate(order):
        if other.priority < request.priority or (other.priority == request.priority and (
                not goes_first(other) or other.arrival > request.arrival)):
            order.insert(index, request)
            return
    order.append(request)


def count_passed_by_later(waiting: Iterable[Request], scheduled: dict[str, int], charged: set[str]) -> None:
    """Charges the step to each request of ``waiting`` (the queue as the step began) that
    did not run while one of them of no higher priority that arrived later did, towards
    its ``MAX_PREFILL_DEFERRALS`` (once a step: not if ``count_sit_outs`` ``charged`` it).

    Args:
        waiting: the requests that were waiting when the step began (the first
            ``SHORTEST_FIRST_WINDOW`` are enough: no later one was passed).
        scheduled: request id -> tokens this step.
        charged: ids already charged this step.
    """
    waiting = list(waiting)
    latest: dict[int, int] = {}  # priority -> latest arrival among the waiting requests that ran
    for request in waiting:
        if request.request_id in scheduled:
            latest[request.priority] = max(latest.get(request.priority, -1), request.arrival)
    if not latest:
        return
    for request in waiting:
        if request.request_id in scheduled or request.request_id in charged:
            continue
        if any(p <= request.priority and arrival > request.arrival for p, arrival in latest.items()):
            request.num_prefill_deferrals += 1
