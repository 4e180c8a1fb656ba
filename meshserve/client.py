"""A small asyncio client over the generated Gateway stubs (used by the CLI,
the demo, the benchmark and the tests)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Mapping, Sequence

import grpc

from meshserve import structured_output as structured
from meshserve.grpc_server import CHANNEL_OPTIONS, open_channel
from meshserve.sampling import floored_logprob
from meshserve.structured_output import StructuredOutput
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_UNSPECIFIED: "",
}


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    chat: Sequence[tuple[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    priority: int | None = None,
    request_id: str = "",
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    include_stop_str_in_output: bool = False,
    cache_salt: str | None = None,
    logit_bias: Mapping[int, float] | None = None,
    structured_output: StructuredOutput | None = None,
) -> gateway_pb2.GenerateRequest:
    """A ``GenerateRequest`` from text, token ids or chat messages ((role, content) pairs).

    Sampling arguments left None are not set (the gateway's defaults apply).
    ``include_stop_str_in_output``: a choice a stop string ended keeps it in its text.
    ``cache_salt``: the request's prefix cache salt (None: none).
    ``logit_bias``: token id → bias added to its logit (None: none).
    ``structured_output``: the constraint on the generated text (None: none; the gateway
    checks it: ``meshserve.structured_output``).
    """
    req = gateway_pb2.GenerateRequest(request_id=request_id, include_stop_str_in_output=include_stop_str_in_output,
                                      cache_salt=cache_salt)
    if chat is not None:
        req.chat.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in chat)
    elif isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(prompt)
    s = req.sampling
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed), ("min_p", min_p),
                        ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("min_tokens", min_tokens), ("n", n),
                        ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    s.logit_bias.update(logit_bias or {})
    if structured_output is not None:
        structured.to_proto(structured_output, s.structured_output)
    if priority is not None:
        req.priority = priority
    return req


@dataclass(frozen=True)
class Logprob:
    """Logprobs at one position (see ``meshserve.v1.TokenLogprob``).

    Attributes:
        token_id: the position's token (sampled, or the prompt's).
        logprob: its log-probability.
        top: the k most likely ``(token_id, logprob)``, highest first.
        rank: ``token_id``'s rank in the vocabulary (1: the most likely; 0: not known).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0

    @classmethod
    def from_proto(cls, msg) -> "Logprob":
        return cls(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top), msg.rank)

    def as_json(self) -> dict:
        """A JSON-ready dict; a logprob of -inf (a token a structured output forbids) is
        ``meshserve.sampling.LOGPROB_FLOOR``, as the HTTP API writes it (JSON has no infinity)."""
        return {"token_id": self.token_id, "logprob": floored_logprob(self.logprob), "rank": self.rank,
                "top": [[token_id, floored_logprob(logprob)] for token_id, logprob in self.top]}


@dataclass
class Completion:
    """One finished choice of a Generate call, as the client saw it.

    Attributes:
        index: the choice, in [0, n).
        text: the concatenated text deltas.
        pieces: each text delta in order.
        token_ids: generated token ids.
        prompt_token_ids: the prompt's ids (from the final message).
        finish_reason: "stop", "length" or "abort".
        usage / timings: from the final message (timings in seconds).
        client_ttft_s: time to the first token-carrying message, measured here.
        token_times: arrival times (time.monotonic) of each token, measured here.
        logprobs: with ``logprobs`` asked, one entry per generated token.
        prompt_logprobs: with ``prompt_logprobs`` asked (choice 0): one entry per
            prompt position 1 .. len(prompt_token_ids) - 1.
        stop_reason: the stop string that ended it ("" when none did).
        stop_token_id: the one of ``stop_token_ids`` that ended it (None when none did).
        cached: the gateway's result cache answered (no executor ran).
        task_id: the async task that produced it ("" for a Generate stream).
    """

    index: int = 0
    text: str = ""
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    stop_token_id: int | None = None
    executor_id: str = ""
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    queue_updates: int = 0
    client_ttft_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    cached: bool = False
    task_id: str = ""

    def as_json(self) -> dict:
        """The ``--json`` form printed by ``meshserve generate`` (logprobs only when asked)."""
        out = {
            "index": self.index,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason or None,  # null when no stop string ended it, as over HTTP
            "stop_token_id": self.stop_token_id,
            "executor_id": self.executor_id,
            "usage": self.usage,
            "timings": self.timings,
            "cached": self.cached,
        }
        if self.task_id:
            out["task_id"] = self.task_id
        if self.logprobs:
            out["logprobs"] = [lp.as_json() for lp in self.logprobs]
        if self.prompt_logprobs:
            out["prompt_logprobs"] = [lp.as_json() for lp in self.prompt_logprobs]
        return out


async def stream(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, metadata=(), timeout: float | None = None
) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Yields the raw Generate stream."""
    async for msg in stub.Generate(request, metadata=metadata, timeout=timeout):
        yield msg


async def generate_choices(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, metadata=(), timeout: float | None = None,
    on_delta=None,
) -> list[Completion]:
    """Runs one Generate call to the end; returns its ``n`` choices by index.
    ``on_delta(text, token_ids, index)`` sees each delta.

    Raises:
        grpc.aio.AioRpcError: the call failed (status code and message as sent).
    """
    choices: dict[int, Completion] = {}
    queue_updates = 0
    start = time.monotonic()
    async for msg in stub.Generate(request, metadata=metadata, timeout=timeout):
        kind = msg.WhichOneof("kind")
        if kind == "queue":
            queue_updates += 1
        elif kind == "delta":
            d = msg.delta
            out = choices.setdefault(d.index, Completion(index=d.index))
            now = time.monotonic()
            if d.token_ids and not out.token_ids:
                out.client_ttft_s = now - start
            out.token_times.extend([now] * len(d.token_ids))
            out.token_ids.extend(d.token_ids)
            out.logprobs.extend(Logprob.from_proto(lp) for lp in d.logprobs)
            out.pieces.append(d.text)
            out.text += d.text
            if on_delta is not None:
                on_delta(d.text, list(d.token_ids), d.index)
        else:
            r = msg.result
            out = choices.setdefault(r.index, Completion(index=r.index))
            out.prompt_token_ids = list(r.prompt_token_ids)
            out.prompt_logprobs = [Logprob.from_proto(lp) for lp in r.prompt_logprobs]
            out.finish_reason = FINISH_NAMES[r.finish_reason]
            out.stop_reason = r.stop_reason
            out.stop_token_id = r.stop_token_id if r.HasField("stop_token_id") else None
            out.executor_id = r.executor_id
            out.cached = r.cached
            out.usage = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                         "cached_tokens": r.usage.cached_tokens, "kvstore_tokens": r.usage.kvstore_tokens}
            out.timings = {"queue_s": r.timings.queue_s, "ttft_s": r.timings.ttft_s, "tpot_s": r.timings.tpot_s,
                           "e2e_s": r.timings.e2e_s}
    for out in choices.values():
        out.queue_updates = queue_updates
    return [choices[i] for i in sorted(choices)]


async def generate(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, metadata=(), timeout: float | None = None,
    on_delta=None,
) -> Completion:
    """Runs a one-choice Generate call to the end; ``on_delta(text, token_ids)`` sees
    each delta. Use ``generate_choices`` for ``n`` > 1.

    Raises:
        grpc.aio.AioRpcError: the call failed (status code and message as sent).
        ValueError: the call returned more than one choice.
    """
    hook = None if on_delta is None else (lambda text, ids, _index: on_delta(text, ids))
    choices = await generate_choices(stub, request, metadata, timeout, hook)
    if len(choices) > 1:
        raise ValueError(f"generate() returns one choice, the call returned {len(choices)}: use generate_choices()")
    return choices[0] if choices else Completion()


def channel(address: str, tls: TLSConfig = PLAINTEXT) -> grpc.aio.Channel:
    """A channel with the mesh's options: TLS with ``tls`` (``meshserve.tls``), or plaintext."""
    return open_channel(address, tls, CHANNEL_OPTIONS)


# Async tasks ------------------------------------------------------------------

TASK_STATE_NAMES = {
    gateway_pb2.TASK_STATE_QUEUED: "queued",
    gateway_pb2.TASK_STATE_RUNNING: "running",
    gateway_pb2.TASK_STATE_SUCCEEDED: "succeeded",
    gateway_pb2.TASK_STATE_FAILED: "failed",
    gateway_pb2.TASK_STATE_CANCELLED: "cancelled",
}
FINAL_TASK_STATES = (gateway_pb2.TASK_STATE_SUCCEEDED, gateway_pb2.TASK_STATE_FAILED,
                     gateway_pb2.TASK_STATE_CANCELLED)


class TaskFailed(Exception):
    """A task ended FAILED or CANCELLED.

    Attributes:
        status: its final ``TaskStatus``; ``code``: the error's status code name
            (``"CANCELLED"`` for a cancelled task); ``message``: its message.
    """

    def __init__(self, status: gateway_pb2.TaskStatus):
        cancelled = status.state == gateway_pb2.TASK_STATE_CANCELLED
        self.status = status
        self.code = "CANCELLED" if cancelled else status.error.code
        self.message = "the task was cancelled" if cancelled else status.error.message
        super().__init__(f"task {status.task_id} {TASK_STATE_NAMES[status.state]}: {self.code}: {self.message}")


def task_completions(status: gateway_pb2.TaskStatus) -> list[Completion]:
    """The choices of a SUCCEEDED task as ``Completion``s, by index (no client-side timings)."""
    out = []
    for c in status.choices:
        r = c.result
        out.append(Completion(
            index=c.index, text=c.text, pieces=[c.text], token_ids=list(c.token_ids),
            prompt_token_ids=list(r.prompt_token_ids), finish_reason=FINISH_NAMES[r.finish_reason],
            stop_reason=r.stop_reason, executor_id=r.executor_id,
            stop_token_id=r.stop_token_id if r.HasField("stop_token_id") else None,
            usage={"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                   "cached_tokens": r.usage.cached_tokens, "kvstore_tokens": r.usage.kvstore_tokens},
            timings={"queue_s": r.timings.queue_s, "ttft_s": r.timings.ttft_s, "tpot_s": r.timings.tpot_s,
                     "e2e_s": r.timings.e2e_s},
            logprobs=[Logprob.from_proto(lp) for lp in c.logprobs],
            prompt_logprobs=[Logprob.from_proto(lp) for lp in r.prompt_logprobs], cached=r.cached,
            task_id=status.task_id))
    return sorted(out, key=lambda c: c.index)


async def submit_task(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest,
                      metadata=(), timeout: float | None = None) -> gateway_pb2.TaskHandle:
    """Submits ``request`` as an async task; returns its handle (task id, state).

    Raises:
        grpc.aio.AioRpcError: refused (INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED…).
    """
    return await stub.SubmitTask(request, metadata=metadata, timeout=timeout)


async def get_task(stub: gateway_pb2_grpc.GatewayStub, task_id: str, metadata=(),
                   timeout: float | None = None) -> gateway_pb2.TaskStatus:
    """The task's status. Raises ``grpc.aio.AioRpcError`` (NOT_FOUND for an unknown,
    expired or other tenant's task)."""
    return await stub.GetTask(gateway_pb2.TaskQuery(task_id=task_id), metadata=metadata, timeout=timeout)


async def cancel_task(stub: gateway_pb2_grpc.GatewayStub, task_id: str, metadata=(),
                      timeout: float | None = None) -> gateway_pb2.TaskStatus:
    """Cancels the task; returns its status (CANCELLED, or its final state if it had
    already finished). Raises ``grpc.aio.AioRpcError`` (NOT_FOUND)."""
    return await stub.CancelTask(gateway_pb2.TaskQuery(task_id=task_id), metadata=metadata, timeout=timeout)


async def wait_task(stub: gateway_pb2_grpc.GatewayStub, task_id: str, metadata=(), poll_s: float = 0.25,
                    timeout_s: float | None = None) -> gateway_pb2.TaskStatus:
    """Polls ``GetTask`` every ``poll_s`` seconds until the task is final; returns that status.

    Raises:
        grpc.aio.AioRpcError: a poll failed (NOT_FOUND…).
        TimeoutError: not final after ``timeout_s`` seconds.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = await get_task(stub, task_id, metadata)
        if status.state in FINAL_TASK_STATES:
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} still {TASK_STATE_NAMES[status.state]} after {timeout_s} s")
        await asyncio.sleep(poll_s)


async def run_task(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, metadata=(),
                   poll_s: float = 0.25, timeout_s: float | None = None, on_submitted=None) -> list[Completion]:
    """Submits ``request`` as a task, polls until it is final, returns its choices;
    ``on_submitted(handle)`` sees the ``TaskHandle`` as soon as it is accepted.

    Raises:
        grpc.aio.AioRpcError: the submit or a poll failed.
        TaskFailed: the task ended FAILED or CANCELLED.
        TimeoutError: see ``wait_task``.
    """
    handle = await submit_task(stub, request, metadata)
    if on_submitted is not None:
        on_submitted(handle)
    status = await wait_task(stub, handle.task_id, metadata, poll_s, timeout_s)
    if status.state != gateway_pb2.TASK_STATE_SUCCEEDED:
        raise TaskFailed(status)
    return task_completions(status)
