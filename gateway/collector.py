"""Finished choices ↔ a stream of events (pure core, plain data).

``ChoiceCollector`` gathers the events of one request (``gateway.events``) into
one ``CompletedChoice`` per choice (full text, every token id and logprob, the
final ``ChoiceResult``): the result of a task, and the value the result cache
keeps. ``replay`` turns such choices back into events — per choice one delta
with all its text and tokens, then its result marked ``cached`` — which is how
the gateway answers a result-cache hit.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

from gateway.events import ChoiceResult, Delta, Event, FinishReason, Timings, TokenLogprob

_COMPLETE = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass(frozen=True, slots=True)
class CompletedChoice:
    """Everything one choice's events carried.

    Attributes:
        index: the choice, in [0, n).
        text: the full text (stop strings cut off, as streamed).
        token_ids: every generated token id, in order.
        logprobs: with logprobs asked: one entry per token id.
        result: the choice's ``ChoiceResult`` (None when the stream ended before it).
    """

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    result: ChoiceResult | None = None


@dataclass
class _Parts:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    result: ChoiceResult | None = None


class ChoiceCollector:
    """Accumulates deltas and results by choice index."""

    def __init__(self) -> None:
        self._parts: dict[int, _Parts] = {}

    def feed(self, event: Event) -> None:
        """Takes one event (queue updates are ignored)."""
        if isinstance(event, Delta):
            parts = self._parts.setdefault(event.index, _Parts())
            parts.text.append(event.text)
            parts.token_ids.extend(event.token_ids)
            parts.logprobs.extend(event.logprobs)
        elif isinstance(event, ChoiceResult):
            self._parts.setdefault(event.index, _Parts()).result = event

    def choices(self) -> list[CompletedChoice]:
        """The choices seen, by index."""
        return [CompletedChoice(i, "".join(p.text), tuple(p.token_ids), tuple(p.logprobs), p.result)
                for i, p in sorted(self._parts.items())]

    def complete(self, n: int) -> bool:
        """True when choices 0 … n-1 all ended by a stop condition or their length
        (not aborted): only such outputs may be cached."""
        return sorted(self._parts) == list(range(n)) and all(
            p.result is not None and p.result.finish_reason in _COMPLETE for p in self._parts.values())


def replay(choices: Sequence[CompletedChoice], request_id: str, start: float) -> list[Delta | ChoiceResult]:
    """The events a result-cache hit yields: per choice, one delta with all its text,
    token ids and logprobs, then its result with ``cached`` set, this request's
    id, no executor, and this call's timings (queue 0; TTFT = e2e = now - start).

    Args:
        choices: the cached choices, by index (each with its result).
        request_id: this request's id.
        start: when the gateway received this request (``time.monotonic()`` s).
    """
    elapsed = time.monotonic() - start
    timings = Timings(queue_s=0.0, ttft_s=elapsed, tpot_s=0.0, e2e_s=elapsed)
    out: list[Delta | ChoiceResult] = []
    for c in choices:
        out.append(Delta(c.index, c.text, c.token_ids, c.logprobs, last=True))
        out.append(dataclasses.replace(c.result, request_id=request_id, executor_id="", cached=True, timings=timings))
    return out
