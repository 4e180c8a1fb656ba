"""Per-choice output state of one request (pure core: plain data, no protobuf).

A request with ``n`` choices gets one executor stream whose outputs interleave
the choices (``ExecutorOutput.index``). Each choice has its own incremental
detokenizer and stop-string matcher, token counts and token times, so it is cut,
timed and counted exactly as a request of its own::

    choices = [Choice(i, tokenizer, prompt_ids, params.stop) for i in range(n)]
    for out in executor_stream:
        choice = choices[out.index]
        if choice.done: continue          # stopped by a stop string: later tokens are dropped
        send(choice.feed(out, now))       # a Delta
        if choice.done: send(choice.result(...))
        if all done: cancel the executor call

A choice cut by a stop string keeps running in the executor until every choice
is done (one call cannot abort one choice); its later tokens are dropped here.
"""

from __future__ import annotations

import time
from typing import Sequence

from gateway.detokenizer import IncrementalDetokenizer
from gateway.events import ChoiceResult, Delta, FinishReason, Timings, TokenLogprob, Usage
from gateway.mesh import ExecutorOutput
from gateway.stop_strings import StopStringMatcher


class RequestTimer:
    """When the gateway got the request and when the scheduler assigned it
    (``time.monotonic()`` seconds).

    Args:
        start: when the request arrived (default: now).
    """

    def __init__(self, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self.assigned = 0.0
        self.first_token = 0.0  # the first token of any choice


class Choice:
    """One choice's detokenizer, stop-string matcher, counts and token times.

    Args:
        index: the choice, in [0, n).
        tokenizer: the model's tokenizer (for the detokenizer).
        prompt_token_ids: the prompt (decoding context of the detokenizer).
        stop: the request's stop strings.
        stop_token_ids: the request's ``stop_token_ids``.
        eos_token_id: the model's EOS id (None with ``ignore_eos``): a choice it ends has
            no ``stop_token_id`` even when ``stop_token_ids`` lists it (vLLM's
            ``check_stop`` tests the EOS first).
    """

    def __init__(self, index: int, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str],
                 stop_token_ids: Sequence[int] = (), eos_token_id: int | None = None):
        self.index = index
        self.stop_token_ids = frozenset(stop_token_ids)
        self.eos_token_id = eos_token_id
        self.stop_token_id: int | None = None
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_token_ids)
        self.stops = StopStringMatcher(stop)
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.num_kvstore_tokens = 0  # of num_cached_tokens, loaded from the kvstore
        self.first_token = self.last_token = 0.0
        self.finish_reason: FinishReason | None = None
        self.stop_reason = ""
        self.prompt_logprobs: list[TokenLogprob] = []

    @property
    def done(self) -> bool:
        """The choice finished (in the executor, or by a stop string here)."""
        return self.finish_reason is not None

    def feed(self, out: ExecutorOutput, now: float) -> Delta:
        """Takes one executor output of this choice; returns the delta to send.

        The delta's text is what became final (cut before a stop string); its
        token ids and logprobs are all the message's.
        """
        if out.token_ids:
            if not self.first_token:
                self.first_token = now
                self.num_cached_tokens = out.num_cached_tokens
                self.num_kvstore_tokens = out.num_kvstore_tokens
            self.last_token = now
        self.prompt_logprobs.extend(out.prompt_logprobs)
        self.num_tokens += len(out.token_ids)
        # the token that stopped the request in the engine (an EOS, or one of stop_token_ids)
        # is counted and returned as an id, but its text is not output (vLLM's rule; with
        # include_stop_str_in_output the core adds it: ``stop_token_text``)
        held = 1 if out.finish_reason == FinishReason.STOP and out.token_ids else 0
        text, matched = self.stops.feed(self.detok.add(out.token_ids[:len(out.token_ids) - held]))
        if out.finish_reason and matched is None:
            more, matched = self.stops.feed(self.detok.finish())
            text += more
            if matched is None:
                text += self.stops.flush()
            self.finish_reason = out.finish_reason
            last = out.token_ids[-1] if held and matched is None else None
            if last is not None and last in self.stop_token_ids and last != self.eos_token_id:
                self.stop_token_id = last  # vLLM's stop_reason for it
        if matched is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, matched
        return Delta(self.index, text, out.token_ids, out.logprobs)

    def result(self, request_id: str, prompt_token_ids: Sequence[int], executor_id: str,
               timer: RequestTimer) -> ChoiceResult:
        """This choice's final event: usage and timings are the choice's own."""
        return ChoiceResult(
            request_id=request_id,
            index=self.index,
            finish_reason=self.finish_reason,
            usage=Usage(prompt_tokens=len(prompt_token_ids), completion_tokens=self.num_tokens,
                        cached_tokens=self.num_cached_tokens, kvstore_tokens=self.num_kvstore_tokens),
            timings=self.timings(timer),
            prompt_token_ids=tuple(prompt_token_ids),
            executor_id=executor_id,
            stop_reason=self.stop_reason,
            stop_token_id=self.stop_token_id,
            prompt_logprobs=tuple(self.prompt_logprobs),
        )

    def timings(self, timer: RequestTimer) -> Timings:
        """Queue time, TTFT, TPOT and e2e of this choice, in seconds."""
        now = time.monotonic()
        first = self.first_token or now
        n = self.num_tokens
        return Timings(
            queue_s=(timer.assigned or now) - timer.start,
            ttft_s=first - timer.start if self.first_token else 0.0,
            tpot_s=(self.last_token - first) / (n - 1) if n > 1 else 0.0,
            e2e_s=now - timer.start,
        )


def stop_token_text(tokenizer, token_ids: Sequence[int]) -> str:
    """The text of the last of ``token_ids`` (the token that stopped a choice in the
    engine), decoded after the ones before it as the choice's detokenizer would have
    decoded it (special tokens, such as an EOS, give ""). ``token_ids``: the choice's
    last few ids (up to 8 are enough: ``IncrementalDetokenizer``'s window)."""
    if not token_ids:
        return ""
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=token_ids[:-1])
    return detok.add(token_ids[-1:]) + detok.finish()
