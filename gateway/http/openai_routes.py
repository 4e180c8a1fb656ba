"""The OpenAI-compatible routes: ``GET /v1/models``, ``GET /v1/models/{model}``,
``POST /v1/completions``,
``POST /v1/chat/completions``, streamed (server-sent events) and not.

A request: read the body (``gateway.http.bodies``: a JSON object, else 415 or
400 saying why), authenticate (``Authorization: Bearer KEY`` or ``x-api-key`` → the
tenant, exactly as the gRPC API key: a caller without a valid key gets 401 whatever
the fields say), validate the body (pydantic: 400 naming the field), convert it (``gateway.http.convert``),
run one core stream per prompt (``GatewayCore.generate``) in an ``EventPump``,
await its first event (so an error before any output gets its HTTP status), then:

* not streamed: collect every choice (``ChoiceCollector``) and answer one object
  (with vLLM's ``prompt_logprobs`` when asked: only such a response carries them);
* streamed: ``text/event-stream``, one ``data: <json>`` event per chunk: the
  assistant role once per choice index (chat), each delta, the last tokens' with
  the finish reason per index, with ``stream_options.include_usage`` a last chunk
  with the usage and no choices (and with vLLM's ``continuous_usage_stats`` each
  chunk its choice's usage so far), then ``data: [DONE]``. An error after the
  stream started is one ``data: {"error": …}`` event before ``[DONE]``.

A client that disconnects cancels the core's streams at once, as a cancelled gRPC
call does: the executor call is cancelled (the engine frees the request's KV
blocks) and the lease is released. The response then is 499 (the client closed
the request; what an access log records). A stopping gateway whose grace runs out
ends the core streams still running the same way, with UNAVAILABLE
(``gateway.running``): 503, or an error event then ``[DONE]`` once streaming.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.collector import ChoiceCollector
from gateway.events import ChoiceResult, Delta
from gateway.generation import GatewayCore
from gateway.http.bodies import json_object
from gateway.http.convert import chat_request, completion_requests, lone_prompt_index, naming_prompt, prompt_named
from gateway.http.errors import http_error
from gateway.http.formats import ChatFormat, CompletionFormat, merge_choices, usage_of
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.http.streams import ClientDisconnected, EventPump, until_disconnect
from gateway.http.unsupported import refuse_unstreamable
from gateway.request import GenerationRequest, SpanOptions
from gateway.tenants import Tenant, TenantRegistry
from meshserve.errors import InvalidArgument
from meshserve.telemetry import context_from_metadata

CLIENT_CLOSED = 499  # nginx's "client closed request"


def headers_of(request: Request) -> list[tuple[str, str]]:
    """The request's headers as (lower-case name, value) pairs: the metadata the
    tenant registry and the trace context read."""
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]


def _sse(data: dict | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


class OpenAIRoutes:
    """The routes over one core.

    Args:
        core: the gateway core.
        tenants: API keys → tenants.
    """

    def __init__(self, core: GatewayCore, tenants: TenantRegistry):
        self.core = core
        self.tenants = tenants
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        # ``:path``: a served name may hold slashes (``HuggingFaceTB/SmolLM2-135M-Instruct``)
        self.router.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    @property
    def served_name(self) -> str:
        """The model name responses carry."""
        return self.core.model.names[0]

    def _card(self, name: str) -> dict:
        """OpenAI's model object of the served name ``name`` (with vLLM's ``root`` and
        ``max_model_len``)."""
        info = self.core.model
        return {"id": name, "object": "model", "created": 0, "owned_by": "meshserve", "root": info.model_id,
                "max_model_len": info.max_model_len}

    async def models(self, request: Request) -> dict:
        """``GET /v1/models``: every served name, as OpenAI's model list."""
        self.tenants.authenticate(headers_of(request))
        return {"object": "list", "data": [self._card(name) for name in self.core.model.names]}

    async def model(self, model: str, request: Request) -> dict:
        """``GET /v1/models/{model}``: one served name's model object (what the openai
        client's ``models.retrieve`` reads).

        Raises:
            ModelNotFound: ``model`` is not served (404 ``model_not_found``, as a
                completion naming it gets).
        """
        self.tenants.authenticate(headers_of(request))
        self.core.model.check_served(model)
        return self._card(model)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        received_at = time.monotonic()
        raw = await json_object(request)
        tenant = self.tenants.authenticate(headers_of(request))  # before the fields: 401 for any body
        body = CompletionRequest.model_validate(raw)
        request_id = body.request_id or uuid.uuid4().hex
        requests = completion_requests(body, request_id)
        refuse_unstreamable(body)
        fmt = CompletionFormat(f"cmpl-{request_id}", body.model or self.served_name, body.n, self.core.tokenizer,
                               body.logprobs is not None, body.return_token_ids, body.prompt_logprobs is not None,
                               echo=[r.prompt for r in requests] if body.echo else None,
                               echo_only=body.max_tokens == 0, echo_top=body.logprobs or 0)
        return await self._serve(request, body, tenant, requests, fmt, received_at, prompts=True,
                                 lone_prompt=lone_prompt_index(body.prompt))

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        received_at = time.monotonic()
        raw = await json_object(request)
        tenant = self.tenants.authenticate(headers_of(request))  # before the fields: 401 for any body
        body = ChatCompletionRequest.model_validate(raw)
        request_id = body.request_id or uuid.uuid4().hex
        gen = chat_request(body, self.core.model.max_model_len, request_id)
        refuse_unstreamable(body)
        fmt = ChatFormat(f"chatcmpl-{request_id}", body.model or self.served_name, body.n, self.core.tokenizer,
                         body.logprobs, body.return_token_ids, body.prompt_logprobs is not None)
        return await self._serve(request, body, tenant, [gen], fmt, received_at)

    async def _serve(self, request: Request, body: SamplingFields, tenant: Tenant,
                     requests: list[GenerationRequest], fmt: ChatFormat | CompletionFormat,
                     received_at: float, prompts: bool = False, lone_prompt: int | None = None) -> Response:
        """Runs ``requests`` and answers them as ``fmt`` says; ``prompts``: they are a
        completions body's, and a prompt's error names it as the body does (a body's
        only prompt as ``lone_prompt`` says: ``lone_prompt_index``)."""
        options = SpanOptions(parent=context_from_metadata(headers_of(request)), stream=body.stream,
                              attributes={"enduser.id": body.user} if body.user else {})
        on_done = None
        if len(requests) == 1:
            streams = [self.core.generate(requests[0], tenant, options, received_at,
                                          on_prepared=lambda prepared: fmt.set_prompt_ids(0, prepared.prompt_ids))]
            if prompts:
                streams = [naming_prompt(streams[0], lone_prompt)]
        else:  # every prompt validated before any is admitted: a bad one must not strand the others' leases
            prepared = []
            try:
                for i, r in enumerate(requests):
                    try:
                        prepared.append(await self.core.prepare_async(r, tenant, received_at))
                    except InvalidArgument as exc:
                        raise prompt_named(exc, i) from None
                    fmt.set_prompt_ids(i, prepared[-1].prompt_ids)
            except BaseException:
                for p in prepared:
                    self.core.end(p)
                raise
            streams = [naming_prompt(self.core.run(p, options), i) for i, p in enumerate(prepared)]

            def on_done() -> None:  # a stream the pump never started was cancelled: its request ends here
                for p in prepared:
                    self.core.end(p, asyncio.CancelledError())
        pump = EventPump([self.core.running.guard(s) for s in streams], on_done=on_done)
        try:
            if not body.stream:
                return JSONResponse(await until_disconnect(request, self._collect(pump, fmt, len(requests))))
            first = await until_disconnect(request, pump.next())
        except ClientDisconnected:
            pump.cancel()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            pump.cancel()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and body.stream_options.continuous_usage_stats  # vLLM's: as its should_include_usage
        return StreamingResponse(self._stream(pump, first, fmt, len(requests), include_usage, continuous),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _collect(self, pump: EventPump, fmt: ChatFormat | CompletionFormat, num_prompts: int) -> dict:
        """The non-streamed response: every event collected, choice by choice."""
        collectors = [ChoiceCollector() for _ in range(num_prompts)]
        while (item := await pump.next()) is not None:
            collectors[item[0]].feed(item[1])
        choices, results, prompts_logprobs = [], [], []
        for p, collector in enumerate(collectors):
            completed = collector.choices()
            prompts_logprobs.append(fmt.prompt_logprobs_of(completed))
            first = next((c.result for c in completed if c.index == 0), None)  # it carries the prompt's logprobs
            for c in completed:
                choices.append(fmt.full_choice(fmt.index(p, c.index), c, first))
                if c.result is not None:
                    results.append(c.result)
        return fmt.response(choices, results, prompts_logprobs)

    async def _stream(self, pump: EventPump, first, fmt: ChatFormat | CompletionFormat, num_prompts: int,
                      include_usage: bool, continuous: bool = False) -> AsyncIterator[bytes]:
        """The SSE body; closing it (the client went away) cancels the pump. ``continuous``
        (vLLM's ``continuous_usage_stats``): each chunk carries its choice's usage so far."""
        results: list[ChoiceResult] = []
        held: dict[int, dict] = {}  # a choice's last tokens' chunk, sent with its finish reason (``Delta.last``)
        generated: dict[int, int] = {}  # each choice's tokens so far (``continuous``)

        def chunk(choice: dict, whole: dict | None = None) -> bytes:
            out = whole or fmt.chunk([choice], with_usage=include_usage)
            if continuous:
                prompt = len(fmt.prompt_ids.get(choice["index"] // fmt.n, ()))
                done = generated.get(choice["index"], 0)
                out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            return _sse(out)

        try:
            for index in range(num_prompts * fmt.n):
                role = fmt.role_chunk(index, include_usage)
                if role is not None:
                    yield chunk(role["choices"][0], role)
            item = first
            while item is not None:
                p, event = item
                choice = None
                if isinstance(event, Delta):
                    index = fmt.index(p, event.index)
                    generated[index] = generated.get(index, 0) + len(event.token_ids)
                    choice = fmt.delta_choice(index, event)
                    if event.last and choice is not None:  # its result follows at once: sent with it
                        held[index] = merge_choices(held[index], choice) if index in held else choice
                        choice = None
                elif isinstance(event, ChoiceResult):
                    results.append(event)
                    index = fmt.index(p, event.index)
                    choice = fmt.finish_choice(index, event)
                    if index in held:
                        choice = merge_choices(held.pop(index), choice)
                if choice is not None:
                    yield chunk(choice)
                item = await pump.next()
            if include_usage:
                yield _sse(fmt.chunk([], usage_of(results), with_usage=True))
        except Exception as exc:  # noqa: BLE001 - the status is sent: the error is an event
            for choice in held.values():  # what was generated is sent before the error
                yield chunk(choice)
            yield _sse(http_error(exc).body())
        finally:
            pump.cancel()
        yield _sse("[DONE]")
