"""A small asyncio client over the generated Gateway stubs (used by the CLI,
the demo, the benchmark and the tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import grpc

from meshserve.grpc_server import CHANNEL_OPTIONS
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
) -> gateway_pb2.GenerateRequest:
    """A ``GenerateRequest`` from text, token ids or chat messages ((role, content) pairs).

    Sampling arguments left None are not set (the gateway's defaults apply).
    """
    req = gateway_pb2.GenerateRequest(request_id=request_id)
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
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_proto(cls, msg) -> "Logprob":
        return cls(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))

    def as_json(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


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
    """

    index: int = 0
    text: str = ""
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    executor_id: str = ""
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    queue_updates: int = 0
    client_ttft_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)

    def as_json(self) -> dict:
        """The ``--json`` form printed by ``meshserve generate`` (logprobs only when asked)."""
        out = {
            "index": self.index,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "executor_id": self.executor_id,
            "usage": self.usage,
            "timings": self.timings,
        }
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
            out.executor_id = r.executor_id
            out.usage = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                         "cached_tokens": r.usage.cached_tokens}
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


def channel(address: str) -> grpc.aio.Channel:
    """An insecure channel with the mesh's options."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
