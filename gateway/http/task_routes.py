"""The async task API over HTTP, next to the OpenAI routes: a thin adapter over
``gateway.task_api.TaskAPI`` (the same calls, tenants and errors as the gRPC
``SubmitTask``/``GetTask``/``CancelTask``).

* ``POST /v1/tasks``: a chat body (``messages``) or a completions body with one
  ``prompt``, as the OpenAI routes take them (``stream`` is ignored; vLLM's chat extras and
  ``include_stop_str_in_output`` travel in the task's ``GenerateRequest``), and an optional
  ``callback_url`` (as SubmitTask's: allow-listed, signed, ``docs/api.md``) → 202 and
  the task's handle ``{"task_id", "state"}``.
* ``GET /v1/tasks/{task_id}``: its ``TaskStatus`` (state, timestamps, then its
  choices or its error) as JSON with the proto's field names; 404 when unknown or
  another tenant's.
* ``POST /v1/tasks/{task_id}/cancel`` (or ``DELETE /v1/tasks/{task_id}``): cancels it,
  answers its status.

The task runs in the gateway, not in the HTTP request: a client that goes away
after the submit leaves it running.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from google.protobuf.json_format import MessageToDict

from gateway.http.bodies import json_object
from gateway.http.convert import chat_request, completion_requests, lone_prompt_index, prompt_named
from gateway.http.openai_routes import headers_of
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, without_nulls
from gateway.proto_convert import request_to_proto
from gateway.task_api import TaskAPI
from meshserve.block_hash import check_cache_salt
from meshserve.errors import InvalidArgument
from meshserve.sampling import validate
from meshserve.v1 import gateway_pb2


class HttpCallContext:
    """What ``TaskAPI`` reads of a call's context, for an HTTP request: its metadata
    (the headers: API key, ``traceparent``)."""

    def __init__(self, request: Request):
        self._metadata = headers_of(request)

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata


def _json(message) -> dict:
    """A message as JSON with the proto's field names, enums by name, every field present."""
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class TaskRoutes:
    """The task routes over one ``TaskAPI``.

    Args:
        tasks: the task adapter (its core, tenants and runner).
    """

    def __init__(self, tasks: TaskAPI):
        self.tasks = tasks
        self.router = APIRouter()
        self.router.add_api_route("/v1/tasks", self.submit, methods=["POST"], status_code=202)
        self.router.add_api_route("/v1/tasks/{task_id}", self.get, methods=["GET"])
        self.router.add_api_route("/v1/tasks/{task_id}/cancel", self.cancel, methods=["POST"])
        self.router.add_api_route("/v1/tasks/{task_id}", self.cancel, methods=["DELETE"])

    def _generate_request(self, body: dict[str, Any]) -> gateway_pb2.GenerateRequest:
        """The body as the ``GenerateRequest`` SubmitTask takes (pydantic errors become 400),
        with its ``callback_url`` (checked against the allow-list by ``TaskAPI.submit``). A
        field sent as null is absent, as on the OpenAI routes; a body with both ``messages``
        and ``prompt`` is refused (which one it meant is not known)."""
        body = without_nulls(body)
        if "messages" in body and "prompt" in body:
            raise InvalidArgument("prompt and messages cannot both be set: a task is a chat (messages) or a "
                                  "completion (prompt)")
        callback_url = body.pop("callback_url", None)
        if callback_url is not None and not isinstance(callback_url, str):
            raise InvalidArgument("callback_url must be a string")
        if callback_url is not None and not callback_url.isascii():
            try:  # JSON can carry a lone surrogate ("\ud800"); the wire cannot
                callback_url.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidArgument(f"callback_url is not valid Unicode: a lone surrogate at character "
                                      f"{exc.start}") from None
        request_id = body.get("request_id") or ""
        parsed = (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)
        if isinstance(parsed, ChatCompletionRequest):
            gen = chat_request(parsed, self.tasks.core.model.max_model_len, request_id)
        else:
            if parsed.echo:  # a task's result is the generation's (GetTask), not an OpenAI answer
                raise InvalidArgument("echo is not available for a task (its result holds the prompt's ids)")
            gens = completion_requests(parsed, request_id)
            if len(gens) != 1:
                raise InvalidArgument("prompt: a task takes one prompt")
            gen = gens[0]
        core = self.tasks.core
        validate(gen.sampling, max_model_len=core.model.max_model_len, vocab_size=core.model.vocab_size)
        check_cache_salt(gen.cache_salt)  # before the wire, which cannot carry a lone surrogate
        core.prompt_limits.check(gen, core.model.max_model_len)  # also refuses lone surrogates in the prompt
        try:
            message = request_to_proto(gen)
        except (ValueError, UnicodeEncodeError) as exc:  # a value the wire cannot carry: the caller's mistake
            raise InvalidArgument(f"The request holds a value the wire cannot carry: {exc}") from None
        message.callback_url = callback_url or ""
        return message

    async def submit(self, request: Request) -> JSONResponse:
        """``POST /v1/tasks`` (the key is checked before the body's fields: a caller
        without a valid key gets 401 for any JSON object; a body that is no JSON
        object at all is refused first, 415 or 400: ``gateway.http.bodies``)."""
        body = await json_object(request)
        context = HttpCallContext(request)
        self.tasks.tenants.authenticate(context.invocation_metadata())
        try:
            generate = self._generate_request(body)
            handle = await self.tasks.submit(generate, context)
        except InvalidArgument as exc:
            raise prompt_named(exc, lone_prompt_index(body.get("prompt"))) from None  # a chat's errors unchanged
        return JSONResponse(_json(handle), status_code=202)

    async def get(self, task_id: str, request: Request) -> dict:
        """``GET /v1/tasks/{task_id}``."""
        return _json(await self.tasks.get(gateway_pb2.TaskQuery(task_id=task_id), HttpCallContext(request)))

    async def cancel(self, task_id: str, request: Request) -> dict:
        """``POST /v1/tasks/{task_id}/cancel`` and ``DELETE /v1/tasks/{task_id}``."""
        return _json(await self.tasks.cancel(gateway_pb2.TaskQuery(task_id=task_id), HttpCallContext(request)))
