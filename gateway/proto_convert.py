"""The gateway's plain data ↔ ``meshserve.v1`` protobuf messages (for the gRPC adapters
and the mesh client; the core never sees a message).

Every message built here has exactly the fields the gateway sent before it had a
core (same presence, same values), so the wire is unchanged: results carry their
``usage`` and ``timings`` sub-messages even when zero; a task's choices are
``TaskChoice`` messages inside a serialized ``TaskStatus``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from gateway.collector import CompletedChoice
from gateway.events import (ChoiceResult, Delta, Event, FinishReason, Queued, Timings, TokenLogprob, TopLogprob,
                            Usage)
from gateway.request import ChatOptions, GenerationRequest
from meshserve.sampling import params_from_proto, to_proto
from meshserve.v1 import common_pb2, gateway_pb2

FINISH_REASONS = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
                  FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
                  FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT}
_BY_NUMBER = {number: reason for reason, number in FINISH_REASONS.items()}


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """A ``FinishReason`` number as a ``FinishReason`` (UNSPECIFIED: None; a number
    this gateway does not know: ABORT, so the choice still ends)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return _BY_NUMBER.get(value, FinishReason.ABORT)


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    """The ``FinishReason`` number of a reason (None: UNSPECIFIED)."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else FINISH_REASONS[reason]


def logprobs_from_proto(entries: Iterable[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    """Repeated ``TokenLogprob`` messages as values (float32 logprobs as Python floats, exact)."""
    return tuple(TokenLogprob(e.token_id, e.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in e.top), e.rank)
                 for e in entries)


def logprobs_to_proto(entries: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    """``TokenLogprob`` values as messages."""
    return [common_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob, rank=e.rank,
                                    top=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in e.top])
            for e in entries]


def request_from_proto(msg: gateway_pb2.GenerateRequest, default_request_id: str = "") -> GenerationRequest:
    """A ``GenerateRequest`` as a ``GenerationRequest`` (sampling defaulted, not yet
    validated; ``default_request_id`` when the message has none). A chat's rendering
    options become ``ChatOptions`` as the HTTP chat body's do (``chat_template_kwargs``
    as sent: the core parses and checks it)."""
    kind = msg.WhichOneof("input")
    return GenerationRequest(
        prompt=msg.prompt if kind == "prompt" else None,
        chat=tuple((m.role, m.content) for m in msg.chat.messages) if kind == "chat" else None,
        prompt_token_ids=tuple(msg.prompt_token_ids.ids) if kind == "prompt_token_ids" else None,
        sampling=params_from_proto(msg.sampling),
        priority=msg.priority if msg.HasField("priority") else None,
        request_id=msg.request_id or default_request_id,
        model=msg.model if msg.HasField("model") else None,
        chat_options=chat_options_from_proto(msg.chat) if kind == "chat" else ChatOptions(),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
    )


def chat_options_from_proto(chat: gateway_pb2.ChatMessages) -> ChatOptions:
    """A ``ChatMessages``' rendering options (unset ``add_generation_prompt``: true;
    names by position)."""
    return ChatOptions(
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
        continue_final_message=chat.continue_final_message, template_kwargs=chat.chat_template_kwargs,
        names=tuple(m.name if m.HasField("name") else None for m in chat.messages))


def request_to_proto(r: GenerationRequest) -> gateway_pb2.GenerateRequest:
    """A ``GenerationRequest`` as the ``GenerateRequest`` message (the inverse of
    ``request_from_proto``; every sampling field is written, ``add_generation_prompt``
    only when false)."""
    msg = gateway_pb2.GenerateRequest(request_id=r.request_id,
                                      include_stop_str_in_output=r.include_stop_str_in_output)
    if r.chat is not None:
        options = r.chat_options
        names = options.names
        msg.chat.messages.extend(gateway_pb2.ChatMessage(role=role, content=c,
                                                         name=names[i] if i < len(names) else None)
                                 for i, (role, c) in enumerate(r.chat))
        if not options.add_generation_prompt:
            msg.chat.add_generation_prompt = False
        msg.chat.continue_final_message = options.continue_final_message
        msg.chat.chat_template_kwargs = options.template_kwargs
    elif r.prompt is not None:
        msg.prompt = r.prompt
    elif r.prompt_token_ids is not None:
        msg.prompt_token_ids.ids.extend(r.prompt_token_ids)
        msg.prompt_token_ids.SetInParent()
    to_proto(r.sampling, msg.sampling)
    if r.priority is not None:
        msg.priority = r.priority
    if r.model is not None:
        msg.model = r.model
    if r.cache_salt is not None:
        msg.cache_salt = r.cache_salt
    return msg


def result_to_proto(r: ChoiceResult) -> gateway_pb2.GenerateResult:
    """A choice's result as the ``GenerateResult`` message."""
    u, t = r.usage, r.timings
    msg = gateway_pb2.GenerateResult(
        request_id=r.request_id, finish_reason=finish_reason_to_proto(r.finish_reason),
        usage=common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                               cached_tokens=u.cached_tokens, kvstore_tokens=u.kvstore_tokens),
        timings=common_pb2.Timings(queue_s=t.queue_s, ttft_s=t.ttft_s, tpot_s=t.tpot_s, e2e_s=t.e2e_s),
        prompt_token_ids=r.prompt_token_ids, executor_id=r.executor_id, stop_reason=r.stop_reason, index=r.index,
        prompt_logprobs=logprobs_to_proto(r.prompt_logprobs), cached=r.cached)
    if r.stop_token_id is not None:
        msg.stop_token_id = r.stop_token_id
    return msg


def delta_to_proto(d: Delta) -> gateway_pb2.TokenDelta:
    """A delta as the ``TokenDelta`` message."""
    return gateway_pb2.TokenDelta(text=d.text, token_ids=d.token_ids, index=d.index,
                                  logprobs=logprobs_to_proto(d.logprobs))


def response_of(event: Event) -> gateway_pb2.GenerateResponse:
    """An event as the Generate stream's message."""
    if isinstance(event, Delta):
        return gateway_pb2.GenerateResponse(delta=delta_to_proto(event))
    if isinstance(event, ChoiceResult):
        return gateway_pb2.GenerateResponse(result=result_to_proto(event))
    if isinstance(event, Queued):
        return gateway_pb2.GenerateResponse(
            queue=gateway_pb2.QueueUpdate(position=event.position, estimated_wait_s=event.estimated_wait_s))
    raise TypeError(f"not a gateway event: {event!r}")


def task_choice_to_proto(c: CompletedChoice) -> gateway_pb2.TaskChoice:
    """A finished choice as the ``TaskChoice`` message (``result`` unset when it has none)."""
    msg = gateway_pb2.TaskChoice(index=c.index, text=c.text, token_ids=c.token_ids,
                                 logprobs=logprobs_to_proto(c.logprobs))
    if c.result is not None:
        msg.result.CopyFrom(result_to_proto(c.result))
    return msg


def task_result(choices: Sequence[CompletedChoice]) -> bytes:
    """A task's stored result: a serialized ``TaskStatus`` holding only its choices."""
    return gateway_pb2.TaskStatus(choices=[task_choice_to_proto(c) for c in choices]).SerializeToString()


def result_from_proto(msg: gateway_pb2.GenerateResult) -> ChoiceResult:
    """The inverse of ``result_to_proto``."""
    u, t = msg.usage, msg.timings
    return ChoiceResult(request_id=msg.request_id, index=msg.index,
                        finish_reason=finish_reason_from_proto(msg.finish_reason),
                        usage=Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.kvstore_tokens),
                        timings=Timings(t.queue_s, t.ttft_s, t.tpot_s, t.e2e_s),
                        prompt_token_ids=tuple(msg.prompt_token_ids), executor_id=msg.executor_id,
                        stop_reason=msg.stop_reason, prompt_logprobs=logprobs_from_proto(msg.prompt_logprobs),
                        cached=msg.cached,
                        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None)


def task_result_choices(data: bytes) -> list[CompletedChoice]:
    """The inverse of ``task_result``: the finished choices a stored result holds.

    Raises:
        google.protobuf.message.DecodeError: not a serialized ``TaskStatus``.
    """
    status = gateway_pb2.TaskStatus.FromString(data)
    return [CompletedChoice(c.index, c.text, tuple(c.token_ids), logprobs_from_proto(c.logprobs),
                            result_from_proto(c.result) if c.HasField("result") else None)
            for c in status.choices]
