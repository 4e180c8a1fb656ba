"""vLLM's tokenizer routes, at the root as vLLM serves them (not under ``/v1``):
``POST /tokenize`` and ``POST /detokenize``, for clients that count tokens or build
prompts in token space.

``/tokenize`` takes vLLM's two forms, a completion (``prompt``: a string) or a chat
(``messages`` and the chat route's options), and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``. Its ids are exactly those the gateway feeds the engine for
the same ``/v1/completions`` or ``/v1/chat/completions`` request: a chat goes through
the chat route's own conversion (``gateway.http.convert.chat_request``: its refusals,
roles and ``ChatOptions``), and both forms through the core's prompt path
(``GatewayCore.prompt_ids``: the same model check, size limits, prompt memo and
``PromptBuilder``). What differs is vLLM's and said so in ``docs/api.md``: a prompt
longer than ``max_model_len`` is counted, not refused (the caller compares), so is an
empty ``prompt`` (``[]``), and the
completion form's ``add_special_tokens: false``, which ``/v1/completions`` refuses,
leaves out what the tokenizer's post-processor adds (a BOS), so that a fragment can
be tokenized and its ids sent as a token-id prompt.

``/detokenize`` takes ``tokens`` (ids in the tokenizer's vocabulary) and answers
``{"prompt"}``: their decode with special tokens kept, as vLLM decodes them
(``tokenizer.decode(ids)``); a completion's text skips them.

Neither route needs an executor: tokenizing is the gateway's. ``max_model_len`` is the
gateway's too (``ModelInfo``: the model config's context, what ``/v1/models`` reports
and what the gateway checks prompts against); an executor started with a smaller
``--max-model-len`` refuses longer prompts itself. A body must be a JSON object
(``gateway.http.bodies``); then the API key is checked, as on ``POST /v1/tasks``, before
the body's fields (a caller without a valid key learns nothing of the tokenizer).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from gateway.generation import GatewayCore
from gateway.http.bodies import json_object
from gateway.http.convert import chat_request
from gateway.http.openai_routes import headers_of
from gateway.http.schemas import ChatCompletionRequest, without_nulls
from gateway.http.unsupported import Extra
from gateway.request import GenerationRequest
from gateway.tenants import TenantRegistry
from meshserve.errors import InvalidArgument

# The chat form's fields that shape the prompt: read by the chat route's own body and
# conversion, so they are taken and refused exactly as ``/v1/chat/completions`` takes them
# (``tools``, ``chat_template`` and ``add_special_tokens: true`` refused there).
CHAT_PROMPT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                      "add_special_tokens", "chat_template", "tools")
# vLLM's chat-form fields for multimodal inputs, which a text-only chat cannot use: refused
# when set, never ignored (the chat route's other refusals: ``gateway.http.unsupported``).
TOKENIZE_EXTRAS = (Extra("mm_processor_kwargs", "multimodal processing: meshserve serves text only"),
                   Extra("media_io_kwargs", "multimodal inputs: meshserve serves text only"))


class TokenizeOptions(BaseModel):
    """What ``/tokenize`` reads in both forms besides the prompt (vLLM's fields; others are
    ignored, as vLLM ignores them)."""

    model_config = ConfigDict(extra="ignore")

    return_token_strs: StrictBool = False


class TokenizeCompletionRequest(TokenizeOptions):
    """``/tokenize``'s completion form (vLLM's ``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    """``/detokenize``'s body (vLLM's ``DetokenizeRequest``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class TokenizeRoutes:
    """The tokenizer routes over one core.

    Args:
        core: the gateway core (its tokenizer, prompt path and model).
        tenants: API keys → tenants.
    """

    def __init__(self, core: GatewayCore, tenants: TenantRegistry):
        self.core = core
        self.tenants = tenants
        self.router = APIRouter()
        self.router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        self.router.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, request: Request) -> dict:
        """``POST /tokenize``.

        Raises:
            InvalidArgument: a bad or unsupported field (400 naming it), a prompt the
                completion or chat route would refuse.
            ModelNotFound: ``model`` is not served (404).
            Unauthenticated: no valid API key (401).
        """
        body = without_nulls(await json_object(request))  # null: the default, as on the other routes
        self.tenants.authenticate(headers_of(request))
        options = TokenizeOptions.model_validate(body)
        if "messages" in body:
            if "prompt" in body:
                raise InvalidArgument("prompt and messages cannot both be set: tokenize a completion's prompt or a "
                                      "chat's messages")
            ids = await self.core.prompt_ids(self._chat(body))
        elif "prompt" in body:
            form = TokenizeCompletionRequest.model_validate(body)
            ids = await self.core.prompt_ids(GenerationRequest(prompt=form.prompt, model=form.model),
                                             add_special_tokens=form.add_special_tokens)
        else:
            raise InvalidArgument("prompt (a text) or messages (a chat) is required")
        token_strs = None
        if options.return_token_strs:  # off the loop, as the tokenizing: 25 ms for a prompt at the size limit
            token_strs = await asyncio.to_thread(self.core.tokenizer.convert_ids_to_tokens, ids)
        return {"count": len(ids), "max_model_len": self.core.model.max_model_len, "tokens": ids,
                "token_strs": token_strs}

    def _chat(self, body: dict[str, Any]) -> GenerationRequest:
        """The chat form as the chat route's ``GenerationRequest`` (its body model, refusals and conversion)."""
        chat = ChatCompletionRequest.model_validate({key: body[key] for key in CHAT_PROMPT_FIELDS if key in body})
        gen = chat_request(chat, self.core.model.max_model_len, "")
        for extra in TOKENIZE_EXTRAS:
            if extra.name in body:
                raise InvalidArgument(f"{extra.name} is not supported ({extra.what})")
        return gen

    async def detokenize(self, request: Request) -> dict:
        """``POST /detokenize``.

        Raises:
            InvalidArgument: ``tokens`` missing, or an id that is not an integer in the
                tokenizer's vocabulary (400 naming it: ``tokens.3``).
            ModelNotFound: ``model`` is not served (404).
            Unauthenticated: no valid API key (401).
        """
        body = without_nulls(await json_object(request))  # null: the default, as on the other routes
        self.tenants.authenticate(headers_of(request))
        form = DetokenizeRequest.model_validate(body)
        if form.model is not None:
            self.core.model.check_served(form.model)
        return {"prompt": await asyncio.to_thread(self._decode, form.tokens)}

    def _decode(self, ids: list[int]) -> str:
        """``ids`` decoded with special tokens kept (vLLM's detokenize), after the range check
        a token-id prompt gets (``PromptBuilder.from_token_ids``); none: ""."""
        if ids:
            try:
                self.core.prompts.from_token_ids(ids)
            except InvalidArgument as exc:  # its words name a prompt's ids: here they are ``tokens``
                raise InvalidArgument(str(exc).replace("prompt_token_ids", "tokens", 1)) from None
        return self.core.tokenizer.decode(ids)
