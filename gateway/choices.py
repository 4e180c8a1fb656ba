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

import dataclasses
import os
import time
from collections import deque
from typing import Sequence

from gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from gateway.events import ChoiceResult, Delta, Event, FinishReason, Timings, TokenLogprob, Usage
from gateway.mesh import ExecutorOutput
from gateway.stop_strings import StopStringMatcher, first_stop

STOP_TAIL_TOKENS = 8
"""A choice's last ids that tell what its stop token changes in its text (``split_stop_token``):
a character it completes began at most 3 tokens before it (UTF-8: at most 4 bytes)."""


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
        min_tokens: the request's ``min_tokens``: no stop string may end in the text of
            the choice's first ``min_tokens`` tokens (``StopStringMatcher``'s ``can_stop``).
    """

    def __init__(self, index: int, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str],
                 stop_token_ids: Sequence[int] = (), eos_token_id: int | None = None, min_tokens: int = 0):
        self.index = index
        self.min_tokens = min_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.eos_token_id = eos_token_id
        self.stop_token_id: int | None = None
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_token_ids)
        self.tail: deque[int] = deque(maxlen=STOP_TAIL_TOKENS)  # the last ids (``split_stop_token``)
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
        before = self.num_tokens
        self.num_tokens += len(out.token_ids)
        self.tail.extend(out.token_ids)
        # the token that stopped the request in the engine (an EOS, or one of stop_token_ids)
        # is counted and returned as an id, but its text is not output (vLLM's rule; with
        # include_stop_str_in_output the core adds it: ``split_stop_token``), nor the start
        # of a character it completes (vLLM's detokenizer never emits it; here it would be U+FFFD)
        held = 1 if out.finish_reason == FinishReason.STOP and out.token_ids else 0
        ids = out.token_ids[:len(out.token_ids) - held]
        protected = min(max(self.min_tokens - before, 0), len(ids))  # of the first min_tokens: no stop ends there
        text = ""
        # one at a time, as from one token a message: the detokenizer holds back the whole text
        # of a piece that ends inside a character, which would then count as after them
        for token_id in ids[:protected]:
            text += self.stops.feed(self.detok.add((token_id,)), can_stop=False)[0]
        more, matched = self.stops.feed(self.detok.add(ids[protected:]))
        text += more
        if out.finish_reason and matched is None:
            pending = self.detok.finish()
            if held:
                cut = min(split_stop_token(self.tokenizer, self.tail)[0], len(pending))
                pending = pending[:len(pending) - cut]
            more, matched = self.stops.feed(pending, can_stop=self.num_tokens > self.min_tokens)
            text += more
            if matched is None:
                text += self.stops.flush()
            self.finish_reason = out.finish_reason
            last = out.token_ids[-1] if held and matched is None else None
            if last is not None and last in self.stop_token_ids and last != self.eos_token_id:
                self.stop_token_id = last  # vLLM's stop_reason for it
        if matched is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, matched
        return Delta(self.index, text, out.token_ids, out.logprobs, last=self.done)

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


def split_stop_token(tokenizer, token_ids: Sequence[int]) -> tuple[int, str]:
    """What the last of ``token_ids`` (the token that stopped a choice in the engine)
    changes in the choice's text: ``(cut, text)``. ``cut``: how many characters at the
    end of the text without it are the start of a character it completes (U+FFFD there;
    left out, as vLLM's detokenizer never emits them); ``text``: what keeping it adds
    once those are cut (the completed character, and the token's own text; "" for a
    special token such as an EOS). ``token_ids``: the choice's last ids (at most
    ``STOP_TAIL_TOKENS``), the same for the choice (``Choice.feed``: the cut) and the
    core (``include_stop_str_in_output``: the text), so both agree. Where the two texts
    part otherwise (a decoder's clean-up of spaces), nothing is cut and the text is the
    token's decoded after the ones before it, as the choice's detokenizer decodes."""
    if not token_ids:
        return 0, ""
    ids = list(token_ids)
    before = tokenizer.decode(ids[:-1], skip_special_tokens=True) if len(ids) > 1 else ""
    after = tokenizer.decode(ids, skip_special_tokens=True)
    common = len(os.path.commonprefix([before, after]))
    if before[common:].strip(REPLACEMENT_CHAR):
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=ids[:-1])
        return 0, detok.add(ids[-1:]) + detok.finish()
    return len(before) - common, after[common:]


class KeptStops:
    """``include_stop_str_in_output`` over one request's events (``GatewayCore``: after the
    result cache, whose entries hold the text without it): what stopped a choice, to come
    as one more ``Delta`` (no tokens) right before its ``STOP`` result. That is the stop
    string, or the stop token's text (``split_stop_token``; an EOS has none) cut right
    after the first stop string it completes, as vLLM checks the stop strings over the
    stop token's text once it is kept; that stop string is then the result's ``stop_reason``.

    Args:
        tokenizer: the model's tokenizer.
        stop: the request's stop strings.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._text_kept = max((len(s) for s in self.stop), default=1) - 1  # a stop string's start before the token
        self._ids: dict[int, deque[int]] = {}  # each choice's last ids
        self._text: dict[int, str] = {}  # each choice's last characters (``_text_kept``)

    def take(self, event: Event) -> tuple[str, Event]:
        """``(text, event)``: the text to send before ``event`` ("" for none) and the event
        to send (a result whose ``stop_reason`` a stop string in the kept token names)."""
        if isinstance(event, Delta):
            self._ids.setdefault(event.index, deque(maxlen=STOP_TAIL_TOKENS)).extend(event.token_ids)
            if self._text_kept:
                self._text[event.index] = (self._text.get(event.index, "") + event.text)[-self._text_kept:]
            return "", event
        if not isinstance(event, ChoiceResult) or event.finish_reason != FinishReason.STOP:
            return "", event
        if event.stop_reason:
            return event.stop_reason, event
        text = split_stop_token(self.tokenizer, self._ids.get(event.index, ()))[1]
        before = self._text.get(event.index, "")
        buffer = before + text
        match = first_stop(buffer, self.stop, ends_after=len(before))  # the first one ending in ``text``
        if match is None:
            return text, event
        start, stop = match
        return buffer[len(before):start + len(stop)], dataclasses.replace(event, stop_reason=stop, stop_token_id=None)
