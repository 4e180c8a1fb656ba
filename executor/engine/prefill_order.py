"""Short prefills first: the order in which a step takes its prefills.

Every request of a step waits for the whole step, so a short prefill (a
prefix-cache hit's uncached tail, a short prompt) beside a long one gets its first
token as late as the long one. With ``BatchSchedulerConfig.short_prefill_tokens``
= S > 0, ``BatchScheduler`` picks a step's prefills in two passes:

1. ``shorts_only(S)``: the prefills with at most S tokens left to compute;
2. the rest, where ``sits_out`` lets a longer prefill of no higher priority than
   the short ones taken skip the step, at most ``MAX_PREFILL_DEFERRALS`` steps over
   its life.

A short waiting request never passes a long one of higher priority, nor one that
has sat out its steps (it may be waiting for free blocks, which short ones must
not take first). This is shortest-remaining-processing-time order (Schrage, 1968)
at the granularity of a step: the short prefill gets a short step, the long one
waits a few short steps. Decodes are not prefills and always run first.
"""

from __future__ import annotations

from collections.abc import Callable

from executor.engine.request import Request, RequestStatus

MAX_PREFILL_DEFERRALS = 4  # steps a long prefill may sit out for short ones, over its life

# (request, tokens it has left to compute) -> True: take it; False: pass it over;
# None: end the pass over the waiting requests there (a running one is passed over).
Admit = Callable[[Request, int], "bool | None"]


def shorts_only(limit: int) -> Admit:
    """The first pass: takes prefills of at most ``limit`` tokens left; passes over
    longer ones, except that a long waiting request which has sat out
    ``MAX_PREFILL_DEFERRALS`` steps, or a short one behind a passed-over long one of
    higher priority, ends the pass over the waiting requests."""
    passed_over: list[int] = []  # priorities of the long waiting requests passed over

    def admit(request: Request, num_left: int) -> bool | None:
        if num_left > limit:
            if request.status == RequestStatus.RUNNING:
                return False
            if request.num_prefill_deferrals >= MAX_PREFILL_DEFERRALS:
                return None
            passed_over.append(request.priority)
            return False
        return None if passed_over and request.priority < max(passed_over) else True
    return admit


def sits_out(request: Request, num_left: int, limit: int, short_priority: int | None) -> bool:
    """Whether a prefill skips this step in the second pass, and if so counts the step
    against its ``MAX_PREFILL_DEFERRALS``.

    Args:
        request: the running or waiting request.
        num_left: its tokens left to compute (after any prefix-cache hit).
        limit: ``short_prefill_tokens``.
        short_priority: the highest priority of the short prefills the first pass took
            (None: it took none, and nothing sits out).
    """
    if (short_priority is None or num_left <= limit or request.priority > short_priority
            or request.num_prefill_deferrals >= MAX_PREFILL_DEFERRALS):
        return False
    request.num_prefill_deferrals += 1
    return True
