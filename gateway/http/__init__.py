"""The gateway's HTTP adapter: an OpenAI-compatible API over ``GatewayCore``.

* ``app``: the FastAPI application (routes, error handlers, the body limit);
  ``server``: uvicorn serving it in the gateway's own event loop.
* ``openai_routes``: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``;
  ``task_routes``: ``/v1/tasks`` over ``gateway.task_api.TaskAPI``;
  ``tokenize_routes``: vLLM's ``/tokenize`` and ``/detokenize`` (the core's prompt path).
* ``schemas``: the request bodies (pydantic); ``convert``: bodies → ``GenerationRequest``.
* ``formats``, ``logprobs``: OpenAI's response and chunk objects from the core's events.
* ``streams``: several core streams as one, the pump that runs them, client disconnects.
* ``errors``: domain errors → OpenAI's JSON error body and HTTP status.
"""
