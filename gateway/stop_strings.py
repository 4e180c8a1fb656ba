"""Stop strings on streamed text (pure core).

The detokenizer yields text pieces; ``StopStringMatcher`` decides what of them
may reach the client. A stop string may span several pieces (tokens) and may end
in the middle of one, so the matcher holds back the longest tail of the text
that is still the beginning of some stop string: streamed text never contains
any part of a stop string, and nothing after it.

Which occurrence stops the stream: the one that is *completed first* (smallest
end position in the text); among those ending at the same place, the one that
starts first. This is the only rule a stream can apply without waiting for
tokens that may never come, and applying it to the whole text at once gives the
same cut, so streamed and non-streamed responses agree. For a single
stop string S it is simply ``text[:text.index(S)]``.

Text fed with ``can_stop=False`` (the text of a request's first ``min_tokens``
tokens) cannot end a stop string: an occurrence must end after it, though it may
begin inside it (vLLM's rule, ``vllm/v1/engine/detokenizer.py``: its detokenizer
checks the stop strings only once ``min_tokens`` tokens are out, over the text they
did not produce, less a stop string's length).

Cost per ``feed``: one ``str.find`` per stop string over the held tail plus the
new piece, and a suffix check of at most ``max(len(stop)) - 1`` characters.
"""

from __future__ import annotations

from typing import Sequence

from meshserve.errors import InvalidArgument


class StopStringMatcher:
    """Cuts streamed text at the first stop string.

    Usage, per request::

        matcher = StopStringMatcher(params.stop)
        emit, match = matcher.feed(piece)   # for each detokenized piece
        ...                                 # match is not None -> finish "stop"
        emit = matcher.flush()              # at the end when nothing matched

    Raises:
        InvalidArgument: (constructor) an empty stop string (``stop[i]``).
    """

    def __init__(self, stop: Sequence[str]):
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop[{i}] must be a non-empty string")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self._first_chars = frozenset(s[0] for s in self.stop)
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self._fed = 0  # characters fed so far
        self._floor = 0  # no stop string may end at or before this position of the text fed
        self.matched: str | None = None

    def feed(self, text: str, can_stop: bool = True) -> tuple[str, str | None]:
        """Adds the next piece of text. ``can_stop`` False: no stop string may end in
        it (the text of the first ``min_tokens`` tokens); one may still begin there.

        Returns:
            (text that may be emitted now, the stop string that matched or None).
            On a match the emitted text ends right before the stop string; the
            stop string and everything after it are dropped, and later calls
            return ``("", None)``.
        """
        if self.matched is not None:
            return "", None
        buffer = self._held + text
        buffer_start = self._fed - len(self._held)  # where ``buffer`` begins in the text fed
        self._fed += len(text)
        if not can_stop:
            self._floor = self._fed
        cut = first_stop(buffer, self.stop, ends_after=max(0, self._floor - buffer_start))
        if cut is not None:
            start, self.matched = cut
            self._held = ""
            return buffer[:start], self.matched
        hold = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """The held-back tail, at the end of the stream ("" after a match)."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        for k in range(min(len(buffer), self._max_hold), 0, -1):
            if buffer[-k] not in self._first_chars:
                continue
            tail = buffer[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stop):
                return k
        return 0


def first_stop(buffer: str, stop: Sequence[str], ends_after: int = 0) -> tuple[int, str] | None:
    """``(start, stop string)`` of the occurrence in ``buffer`` completed first (the
    module's rule: the smallest end, ties to the earliest start) among those that end
    past position ``ends_after`` (0: any), or None when there is none."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stop:
        start = buffer.find(s, max(0, ends_after - len(s) + 1))
        if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    return None if best is None else (best[1], best[2])
