"""What the OpenAI routes refuse rather than ignore: fields meshserve does not
implement, which would change the output if it did (pure: no HTTP).

Two kinds, both refused with ``InvalidArgument`` (400, ``param`` naming the field):

* OpenAI's fields the bodies declare (``suffix``, ``best_of``
  other than ``n`` (in chat too, as vLLM's chat body takes it), ``tools``…):
  ``refuse_unsupported`` checks their parsed values;
* vLLM's extras (``VLLM_EXTRAS``, the one list of them): the older guided decoding
  fields (vLLM 0.32 takes ``structured_outputs`` and ``response_format`` instead, which
  meshserve serves: ``gateway.http.structured``), structural tags, beam search, token
  masks, prompt truncation, special-token handling of the text, KV transfer
  (disaggregated prefill), multimodal processor arguments… The bodies do not declare
  them: they arrive among a body's unknown fields (``model_extra``), and each is
  refused when its value is not one of those that ask for what meshserve does anyway
  (vLLM's defaults: ``use_beam_search: false`` passes). A field sent as null is its
  default, as every field (dropped before). Other unknown fields are ignored, as
  OpenAI's servers and vLLM ignore them.

What a stream cannot carry is refused by ``refuse_unstreamable``, which only the
OpenAI routes call (a task ignores ``stream``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from meshserve.errors import InvalidArgument


@dataclass(frozen=True)
class Extra:
    """A vLLM request field meshserve does not implement.

    Attributes:
        name: the field, as the body spells it.
        what: what it asks for, or what meshserve does instead (in the refusal's message).
        allowed: the values that ask for nothing more than meshserve does (vLLM's
            defaults); empty: every value is refused.
        routes: ``"chat"``, ``"completions"`` or ``"both"``.
    """

    name: str
    what: str
    allowed: tuple[Any, ...] = ()
    routes: str = "both"


_GUIDED = "vLLM's older guided decoding; use structured_outputs or response_format"
VLLM_EXTRAS: tuple[Extra, ...] = (
    *(Extra(name, _GUIDED) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                        "guided_decoding_backend", "guided_whitespace_pattern")),
    Extra("structural_tag", "structural tags"),
    Extra("use_beam_search", "beam search", (False,)),
    Extra("length_penalty", "beam search", (1.0,)),
    Extra("early_stopping", "beam search", (False,)),
    Extra("allowed_token_ids", "token masks"),
    Extra("bad_words", "token masks", ([],)),
    Extra("logits_processors", "custom logits processors"),
    Extra("vllm_xargs", "custom extension arguments"),
    Extra("thinking_token_budget", "reasoning budgets"),
    Extra("repetition_detection", "repetition detection"),
    Extra("logprob_token_ids", "logprobs of chosen token ids"),
    Extra("return_tokens_as_token_ids", "logprob tokens as token ids", (False,)),
    Extra("truncate_prompt_tokens", "prompt truncation"),
    Extra("prompt_embeds", "prompt embeddings", routes="completions"),
    Extra("kv_transfer_params", "disaggregated prefill: KV transfer between instances"),
    Extra("mm_processor_kwargs", "multimodal processing: meshserve serves text only"),
    Extra("skip_special_tokens", "special tokens are always skipped from the text", (True,)),
    Extra("spaces_between_special_tokens", "special tokens are always skipped from the text", (True,)),
    Extra("add_special_tokens", "the chat template alone adds special tokens", (False,), routes="chat"),
    Extra("add_special_tokens", "a raw prompt gets the tokenizer's special tokens", (True,),
          routes="completions"),
    Extra("echo", "echoing the last message", (False,), routes="chat"),
    Extra("documents", "documents for the chat template", routes="chat"),
    Extra("chat_template", "a chat template per request (the gateway's --chat-template applies)", routes="chat"),
    Extra("reasoning_effort", "reasoning effort", routes="chat"),
)


def _is_allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    """True when ``value`` is one of ``allowed`` (a boolean only as itself: ``1`` is not ``true``)."""
    return any(value is a if isinstance(a, bool) else (not isinstance(value, bool) and value == a)
               for a in allowed)


def _refuse_vllm_extras(body: SamplingFields) -> None:
    """Refuses the first of ``VLLM_EXTRAS`` the body sets to a value meshserve does not serve."""
    route = "chat" if isinstance(body, ChatCompletionRequest) else "completions"
    extra = body.model_extra or {}
    for field in VLLM_EXTRAS:
        if field.routes in (route, "both") and field.name in extra and not _is_allowed(extra[field.name],
                                                                                       field.allowed):
            only = f"; only {field.name}: {json.dumps(field.allowed[0])} is served" if field.allowed else ""
            raise InvalidArgument(f"{field.name} is not supported ({field.what}){only}")


def refuse_unsupported(body: SamplingFields) -> None:
    """Fields meshserve does not implement are refused (400 naming them), never ignored.

    Raises:
        InvalidArgument: the first such field the body sets (the message starts with its name).
    """
    if body.stream_options is not None and not body.stream:  # as vLLM: it would be silently moot
        raise InvalidArgument("stream_options is only allowed with stream: true")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise InvalidArgument("suffix is not supported")
    if body.best_of is not None and body.best_of != body.n:  # chat too: vLLM's chat body takes it
        raise InvalidArgument("best_of must equal n (meshserve returns every choice it generates)")
    if isinstance(body, ChatCompletionRequest):
        if body.tools or body.functions:
            raise InvalidArgument(f"{'tools' if body.tools else 'functions'} are not supported")
        for name in ("tool_choice", "function_call"):  # "none" asks for no call: what meshserve does
            if getattr(body, name) not in (None, "none"):
                raise InvalidArgument(f"{name} is not supported (only \"none\")")
    _refuse_vllm_extras(body)


def refuse_unstreamable(body: SamplingFields) -> None:
    """vLLM's ``prompt_logprobs`` come in a whole response only: with ``stream: true``
    they are refused (vLLM refuses them so for k > 0, and silently drops k = 0), and so
    is a completion's ``echo`` with ``logprobs`` (the echoed prompt's logprobs are
    prompt logprobs).

    Raises:
        InvalidArgument: ``prompt_logprobs`` set on a streamed request, or ``echo``
            with ``logprobs``.
    """
    if body.stream and body.prompt_logprobs is not None:
        raise InvalidArgument("prompt_logprobs is not available with stream: true (only a whole response "
                              "carries it)")
    if body.stream and isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        raise InvalidArgument("echo with logprobs is not available with stream: true (the prompt's logprobs come "
                              "in a whole response only)")
