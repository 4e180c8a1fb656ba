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
) -> gateway_pb2.GenerateRequest:
    """A ``GenerateRequest`` from text, token ids or chat messages ((role, content) pairs)."""
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
                        ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    if priority is not None:
        req.priority = priority
    return req


@dataclass
class Completion:
    """One finished Generate call, as the client saw it.

    Attributes:
        text: the concatenated text deltas.
        pieces: each text delta in order.
        token_ids: generated token ids.
        prompt_token_ids: the prompt's ids (from the final message).
        finish_reason: "stop", "length" or "abort".
        usage / timings: from the final message (timings in seconds).
        client_ttft_s: time to the first token-carrying message, measured here.
        token_times: arrival times (time.monotonic) of each token, measured here.
    """

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

    def as_json(self) -> dict:
        """The ``--json`` form printed by ``meshserve generate``."""
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "executor_id": self.executor_id,
            "usage": self.usage,
            "timings": self.timings,
        }


async def stream(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, metadata=(), timeout: float | None = None
) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Yields the raw Generate stream."""
    async for msg in stub.Generate(request, metadata=metadata, timeout=timeout):
        yield msg


async def generate(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, metadata=(), timeout: float | None = None,
    on_delta=None,
) -> Completion:
    """Runs one Generate call to the end; ``on_delta(text, token_ids)`` sees each delta.

    Raises:
        grpc.aio.AioRpcError: the call failed (status code and message as sent).
    """
    out = Completion()
    start = time.monotonic()
    async for msg in stub.Generate(request, metadata=metadata, timeout=timeout):
        kind = msg.WhichOneof("kind")
        if kind == "queue":
            out.queue_updates += 1
        elif kind == "delta":
            now = time.monotonic()
            if msg.delta.token_ids and not out.token_ids:
                out.client_ttft_s = now - start
            out.token_times.extend([now] * len(msg.delta.token_ids))
            out.token_ids.extend(msg.delta.token_ids)
            out.pieces.append(msg.delta.text)
            out.text += msg.delta.text
            if on_delta is not None:
                on_delta(msg.delta.text, list(msg.delta.token_ids))
        else:
            r = msg.result
            out.prompt_token_ids = list(r.prompt_token_ids)
            out.finish_reason = FINISH_NAMES[r.finish_reason]
            out.stop_reason = r.stop_reason
            out.executor_id = r.executor_id
            out.usage = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                         "cached_tokens": r.usage.cached_tokens}
            out.timings = {"queue_s": r.timings.queue_s, "ttft_s": r.timings.ttft_s, "tpot_s": r.timings.tpot_s,
                           "e2e_s": r.timings.e2e_s}
    return out


def channel(address: str) -> grpc.aio.Channel:
    """An insecure channel with the mesh's options."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
