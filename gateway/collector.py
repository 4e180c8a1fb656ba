"""Finished choices ↔ a Generate stream (pure core, protobuf messages only).

``ChoiceCollector`` gathers the messages of one Generate stream into one
``TaskChoice`` per choice (full text, every token id and logprob, the final
``GenerateResult``): the result of a task, and the value the result cache keeps.
``replay`` turns such choices back into a stream — per choice one delta with
all its text and tokens, then its result marked ``cached`` — which is how the
gateway answers a result-cache hit.
"""

from __future__ import annotations

import time
from typing import Sequence

from meshserve.v1 import common_pb2, gateway_pb2

_COMPLETE = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


class ChoiceCollector:
    """Accumulates deltas and results by choice index."""

    def __init__(self) -> None:
        self._choices: dict[int, gateway_pb2.TaskChoice] = {}

    def feed(self, msg: gateway_pb2.GenerateResponse) -> None:
        """Takes one stream message (queue updates are ignored)."""
        kind = msg.WhichOneof("kind")
        if kind == "delta":
            d = msg.delta
            choice = self._choice(d.index)
            choice.text += d.text
            choice.token_ids.extend(d.token_ids)
            choice.logprobs.extend(d.logprobs)
        elif kind == "result":
            self._choice(msg.result.index).result.CopyFrom(msg.result)

    def _choice(self, index: int) -> gateway_pb2.TaskChoice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = gateway_pb2.TaskChoice(index=index)
        return choice

    def choices(self) -> list[gateway_pb2.TaskChoice]:
        """The choices seen, by index."""
        return [self._choices[i] for i in sorted(self._choices)]

    def complete(self, n: int) -> bool:
        """True when choices 0 … n-1 all ended by a stop condition or their length
        (not aborted): only such outputs may be cached."""
        return sorted(self._choices) == list(range(n)) and all(
            c.HasField("result") and c.result.finish_reason in _COMPLETE for c in self._choices.values())


def replay(choices: Sequence[gateway_pb2.TaskChoice], request_id: str,
           start: float) -> list[gateway_pb2.GenerateResponse]:
    """The stream a result-cache hit sends: per choice, one delta with all its text,
    token ids and logprobs, then its result with ``cached`` set, this request's
    id, no executor, and this call's timings (queue 0; TTFT = e2e = now - start).

    Args:
        choices: the cached choices, by index.
        request_id: this request's id.
        start: when the gateway received this request (``time.monotonic()`` s).
    """
    elapsed = time.monotonic() - start
    out = []
    for c in choices:
        out.append(gateway_pb2.GenerateResponse(delta=gateway_pb2.TokenDelta(
            text=c.text, token_ids=c.token_ids, index=c.index, logprobs=c.logprobs)))
        result = gateway_pb2.GenerateResult()
        result.CopyFrom(c.result)
        result.request_id, result.executor_id, result.cached = request_id, "", True
        result.timings.CopyFrom(common_pb2.Timings(queue_s=0.0, ttft_s=elapsed, tpot_s=0.0, e2e_s=elapsed))
        out.append(gateway_pb2.GenerateResponse(result=result))
    return out
