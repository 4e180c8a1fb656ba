"""The request bodies of the OpenAI-compatible routes, as pydantic models.

Field names, types and defaults follow OpenAI's API reference for
``POST /v1/completions`` and ``POST /v1/chat/completions``, plus the extra
sampling fields vLLM accepts that clients send (``top_k``, ``min_p``,
``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``priority``, ``prompt_logprobs``…) and structured outputs (OpenAI's ``response_format``,
vLLM's ``structured_outputs``: ``gateway.http.structured``). Unknown fields are ignored,
as OpenAI's servers and vLLM do, except vLLM's extras meshserve does not implement
(refused: ``gateway.http.unsupported``).
Numbers are JSON numbers, as in OpenAI's API: an integer field (``max_tokens``,
``n``, ``seed``, token ids…) takes an integer only, never a boolean, a float
(``4.0``) or a string (``"4"``), which pydantic's lax mode would convert
(``true`` → 1; vLLM takes them so); a float field takes any number but not a
boolean or a string; a boolean field (``stream``, ``echo``, ``logprobs`` of a chat…)
takes ``true`` or ``false`` only, never ``1`` or ``"yes"``. ``user`` is at most 256 characters (it becomes the span
attribute ``enduser.id``). Ranges are checked once, by
``meshserve.sampling.validate`` in the core; what is checked here is only what
the core cannot see (types, the OpenAI-only caps such as ``max_tokens`` >= 1 (0 with
a completion's ``echo``) and
``top_logprobs`` <= 20, and fields meshserve does not implement, which are
refused rather than silently ignored).
"""

from __future__ import annotations

from typing import Any

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator,
                      model_validator)

from gateway.prompt import check_template_kwargs_depth

# What one request body may carry before any work is done: the core's
# own caps bound each field; these bound what arrives before the core sees it.
MAX_PROMPTS = 64  # prompts of one /v1/completions request
MAX_MESSAGES = 4096  # messages of one chat request
MAX_USER_CHARS = 256  # ``user``: an end-user id (a span attribute), bounded as ``request_id`` is


def without_nulls(data: Any) -> Any:
    """A body object with its ``null`` fields dropped: each reads as its default, as
    OpenAI's servers and vLLM read it."""
    if isinstance(data, dict):
        return {key: value for key, value in data.items() if value is not None}
    return data


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a last chunk carries the usage
    (``choices`` empty) and every other chunk ``"usage": null``. A field sent as null
    is its default. vLLM's ``continuous_usage_stats`` with ``include_usage``: every
    chunk also carries its choice's usage so far (``gateway.http.openai_routes``)."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False

    _null_is_the_default = model_validator(mode="before")(without_nulls)


class StructuredOutputsFields(BaseModel):
    """vLLM's ``structured_outputs`` object (its ``StructuredOutputsParams``): one kind of
    constraint (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and options
    meshserve serves at their defaults only; ``gateway.http.structured`` checks them. A
    field sent as null is its default; unknown fields are ignored, as vLLM ignores them."""

    model_config = ConfigDict(extra="ignore")

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # an object or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: Any = False
    disable_additional_properties: Any = False
    whitespace_pattern: Any = None
    structural_tag: Any = None

    _null_is_the_default = model_validator(mode="before")(without_nulls)


class SamplingFields(BaseModel):
    """The fields both routes share (OpenAI's, then vLLM's extras). Unknown fields are
    kept aside (``model_extra``) only so that vLLM's extras meshserve does not
    implement are refused (``gateway.http.unsupported``); the others are ignored."""

    model_config = ConfigDict(extra="allow")

    # A top-level ``"field": null`` reads as the field's default (``"n": null`` is 1,
    # ``"stream": null`` false); a required field sent as null is then missing (400).
    _null_is_the_default = model_validator(mode="before")(without_nulls)

    model: str | None = None
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # token id (a decimal string) → bias: gateway.http.convert
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    # vLLM's extra sampling fields
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    min_tokens: StrictInt | None = Field(None, ge=0)
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    priority: StrictInt | None = None
    request_id: str | None = None
    return_token_ids: StrictBool = False  # vLLM's: token ids beside the text (each chunk: its delta's)
    include_stop_str_in_output: StrictBool = False  # vLLM's: the stop string that ended a choice stays in its text
    prompt_logprobs: StrictInt | None = None  # vLLM's: k; each prompt position's logprobs (range: the core's)
    best_of: StrictInt | None = None  # OpenAI's (completions), vLLM's in chat too: refused unless it equals n
    cache_salt: str | None = None  # vLLM's: salts the prefix cache (checked by the core: non-empty, bounded)
    # structured outputs (``gateway.http.structured``); response_format is parsed there, naming it in any error
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsFields | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings (one string is one stop string)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of
    token ids, or a list of token-id lists; each prompt gets ``n`` choices, choice
    ``i`` of the response belonging to prompt ``i // n``."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=0)  # 0: with echo only (``gateway.http.convert``)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None


class ContentPart(BaseModel):
    """A part of a message's content; only ``text`` parts are served (the others are
    refused by ``ChatMessage``, naming their type)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message: ``content`` a string, a list of text parts, or null; ``name``
    (OpenAI's participant name) reaches the chat template as the message's ``name``
    key, as vLLM passes it."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise ValueError(f"only text parts are supported, got a part of type {part.type!r}")
                if part.text is None:
                    raise ValueError("a text part needs its text")
        return content

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the older
    ``max_tokens`` when both are set; with neither, the output may run to the
    model's context (``max_model_len``), as in OpenAI's API and vLLM. vLLM's chat
    extras ``add_generation_prompt``, ``continue_final_message`` and
    ``chat_template_kwargs`` (an object: its keys are template variables) shape the
    rendering (``gateway.prompt``)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None  # OpenAI's older name of tools
    function_call: str | dict[str, Any] | None = None  # ... and of tool_choice
    # vLLM's chat extras
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_too_deep(cls, kwargs):
        if kwargs is not None:
            check_template_kwargs_depth(kwargs)
        return kwargs
