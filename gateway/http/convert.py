"""OpenAI request bodies (``gateway.http.schemas``) → the core's ``GenerationRequest``.

One ``GenerationRequest`` per prompt: a chat request is one, a completions
request with a list of prompts is one per prompt (each with its own ``n``
choices). Unset OpenAI fields leave meshserve's defaults (``meshserve.sampling``);
the core validates every value and names the field when one is out of range.
What meshserve does not implement is refused first (``gateway.http.unsupported``).

Mappings that are not one-to-one:

* chat ``max_completion_tokens`` wins over ``max_tokens``; with neither, the output
  may run to the context (``max_tokens`` = ``max_model_len``, clamped by the engine).
* chat ``logprobs: true`` → ``logprobs`` = ``top_logprobs`` (0: the token's own only);
  completions ``logprobs: k`` → ``logprobs`` = k. vLLM's ``prompt_logprobs: k`` is the
  core's own, in both (a streamed request refuses it: ``refuse_unstreamable``).
* a completion's ``echo`` (vLLM's): the answer starts with the prompt (``gateway.http.formats``),
  and with ``logprobs: k`` it asks for the prompt's logprobs too (``prompt_logprobs`` = k unless
  set). ``max_tokens: 0`` (with ``echo`` only) runs one token, which the answer leaves out.
* ``priority`` is meshserve's priority class (higher runs first; vLLM's runs lower
  first) and is capped by nothing here: the scheduler applies the tenant's rules.
* ``logit_bias``: a JSON object's keys are strings; each must be a token id written
  as a decimal integer, as OpenAI's clients write it (``"50256"``; not ``"05"``,
  ``" 5"`` or ``"5.0"``, which vLLM's ``int()`` takes, so that two keys never name
  one id); ``null`` and ``{}`` are none.
* ``response_format`` and vLLM's ``structured_outputs`` → ``structured_output``, checked
  here so that an error names the field as sent (``gateway.http.structured``).
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import aclosing
from typing import AsyncIterator, TypeVar

from gateway.http.schemas import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.http.structured import structured_output
from gateway.http.unsupported import refuse_unsupported
from gateway.prompt import ROLE_ALIASES, template_kwargs_text
from gateway.prompt_limits import not_unicode
from gateway.request import ChatOptions, GenerationRequest
from meshserve.errors import InvalidArgument
from meshserve.request_ids import check_request_id, suffixed_request_id
from meshserve.sampling import DEFAULT_MAX_TOKENS, SamplingParams


def _sampling(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The request's ``SamplingParams`` (unvalidated: the core validates; the structured
    output is checked here, naming the body's field).

    Raises:
        InvalidArgument: a ``logit_bias`` key that is not a token id; a bad
            ``response_format`` or ``structured_outputs`` (``gateway.http.structured``).
    """
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                    "presence_penalty", "frequency_penalty", "min_tokens")
             if getattr(body, name) is not None}
    return SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=body.stop_strings(),
                          stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, n=body.n,
                          logprobs=logprobs, prompt_logprobs=body.prompt_logprobs,
                          logit_bias=_logit_bias(body.logit_bias or {}), structured_output=structured_output(body),
                          **given)


_TOKEN_ID_KEY = re.compile(r"0|-?[1-9][0-9]{0,17}")  # a decimal integer as str(int) writes it (ranges: the core's)


def _logit_bias(biases: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """``logit_bias``'s string keys as token ids, (id, bias) pairs in the body's order."""
    for key in biases:
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidArgument(f"logit_bias: key {key!r} is not a token id (a decimal integer as OpenAI's "
                                  f"clients write it, such as \"50256\")")
    return tuple((int(key), bias) for key, bias in biases.items())


def chat_request(body: ChatCompletionRequest, max_model_len: int, request_id: str) -> GenerationRequest:
    """A chat body as one ``GenerationRequest``.

    Raises:
        InvalidArgument: a field meshserve does not implement, or a bad structured output.
    """
    refuse_unsupported(body)
    max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs: true")
    return GenerationRequest(chat=tuple((ROLE_ALIASES.get(m.role, m.role), m.text()) for m in body.messages),
                             sampling=_sampling(body, max_tokens, logprobs), priority=body.priority,
                             request_id=request_id, model=body.model, chat_options=_chat_options(body),
                             include_stop_str_in_output=body.include_stop_str_in_output,
                             cache_salt=body.cache_salt)


def _chat_options(body: ChatCompletionRequest) -> ChatOptions:
    """vLLM's chat extras as ``ChatOptions`` (checked against each other by ``gateway.prompt``)."""
    return ChatOptions(add_generation_prompt=body.add_generation_prompt,
                       continue_final_message=body.continue_final_message,
                       template_kwargs=template_kwargs_text(body.chat_template_kwargs),
                       names=tuple(m.name for m in body.messages))


def _prompts(prompt) -> list[str | tuple[int, ...]]:
    """``prompt`` as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidArgument("prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [tuple(prompt)]
    return [p if isinstance(p, str) else tuple(p) for p in prompt]


def completion_requests(body: CompletionRequest, request_id: str) -> list[GenerationRequest]:
    """A completions body as one ``GenerationRequest`` per prompt (ids ``request_id``
    with ``-i`` appended when there are several, cut to fit as ``suffixed_request_id``
    cuts them).

    Raises:
        InvalidArgument: no prompt, more than ``MAX_PROMPTS``, a prompt of several that
            is not valid Unicode (``prompt[1]``), a field meshserve does not implement, or a bad
            structured output.
    """
    refuse_unsupported(body)
    prompts = _prompts(body.prompt)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgument(f"prompt takes at most {MAX_PROMPTS} prompts, got {len(prompts)}")
    if len(prompts) > 1:  # the core sees one prompt at a time: the element is named here
        for i, p in enumerate(prompts):
            if isinstance(p, str) and not p.isascii():
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise not_unicode(f"prompt[{i}]", exc) from None
    if body.max_tokens == 0 and not body.echo:
        raise InvalidArgument("max_tokens must be at least 1 (0 only with echo: the prompt alone)")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else max(body.max_tokens, 1)
    params = _sampling(body, max_tokens, body.logprobs)
    if body.echo and body.prompt_logprobs is None and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)  # the echoed prompt's
    if len(prompts) > 1:
        check_request_id(request_id)  # the caller's own id; each prompt's derived one always fits
    out = []
    for i, p in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else suffixed_request_id(request_id, f"-{i}")
        text, ids = (p, None) if isinstance(p, str) else (None, p)
        out.append(GenerationRequest(prompt=text, prompt_token_ids=ids, sampling=params, priority=body.priority,
                                     request_id=rid, model=body.model,
                                     include_stop_str_in_output=body.include_stop_str_in_output,
                                     cache_salt=body.cache_salt))
    return out


_PROMPT_FIELD = re.compile(r"^prompt(?:_token_ids)?(?=[\s\[]|$)")
T = TypeVar("T")


def lone_prompt_index(prompt: object) -> int | None:
    """How a body's only prompt is named: None for a string or a token list (the body's
    ``prompt`` itself), 0 for a list holding one prompt (``prompt[0]``)."""
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return 0
    return None


def prompt_named(error: InvalidArgument, index: int | None) -> InvalidArgument:
    """A prompt's error with the prompt named as the completions body names it: the
    core's ``prompt_token_ids[3] = …`` and ``prompt has … tokens`` become
    ``prompt[3] = …`` and ``prompt has …`` for a body's only prompt (``index``
    None), ``prompt[1][3] = …`` and ``prompt[1] has …`` for its element 1 (the
    400's ``param`` then reads ``prompt.1.3``). Other errors are returned as they are."""
    name = "prompt" if index is None else f"prompt[{index}]"
    message = _PROMPT_FIELD.sub(name, str(error), count=1)
    return error if message == str(error) else InvalidArgument(message)


async def naming_prompt(stream: AsyncIterator[T], index: int | None) -> AsyncIterator[T]:
    """``stream``, its ``InvalidArgument`` naming the prompt (``prompt_named``)."""
    async with aclosing(stream) as events:
        try:
            async for event in events:
                yield event
        except InvalidArgument as exc:
            raise prompt_named(exc, index) from None
