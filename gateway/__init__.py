"""meshserve gateway: the public API in front of the mesh.

A transport-free core and thin adapters over it::

    gRPC adapter (gateway.server)  ─┐
    task adapter (gateway.task_api) ┼─▶ GatewayCore (gateway.generation) ─▶ MeshClient (gateway.mesh)
    HTTP adapter (gateway.http)    ─┘     prepare → run → events              └ gateway.mesh_client: gRPC

Core (plain data, no protobuf, no gRPC; unit-tested directly):

* ``gateway.generation``: ``GatewayCore``: a request from validation to its last
  token (``prepare``, ``run``, ``generate``), spans and metrics included; its
  parts: ``gateway.preparation`` (``RequestPreparer``: checks, prompt ids, the
  request ids in flight) and ``gateway.mesh_run`` (``MeshRunner``: admission, the
  executor's stream through each choice, the lease).
* ``gateway.request``: what goes in (``GenerationRequest``, ``SpanOptions``,
  ``ModelInfo``) and ``Prepared``; ``gateway.events``: what comes out
  (``Queued``, ``Delta``, ``ChoiceResult``; an adapter learns of the assignment
  through ``run``'s ``on_assigned``; errors are raised as
  ``meshserve.errors.MeshError``, never yielded).
* ``gateway.mesh``: the core's view of the scheduler and executors (``MeshClient``).
* ``gateway.tenants``: API key -> ``Tenant`` (``TenantRegistry``).
* ``gateway.prompt``: raw text / chat messages / token ids -> prompt ids
  (``PromptBuilder``), with the chat template and the special-token policy.
* ``gateway.detokenizer``: output ids -> UTF-8-safe text pieces
  (``IncrementalDetokenizer``).
* ``gateway.stop_strings``: cuts streamed text at stop strings
  (``StopStringMatcher``).
* ``gateway.choices``: one detokenizer + stop-string matcher + counts per choice
  of an ``n`` > 1 request (``Choice``).
* ``gateway.collector``: events -> finished choices, and back
  (``ChoiceCollector``, ``replay``): a task's result, a result-cache entry.
* ``gateway.result_cache``: outputs of deterministic requests (``ResultCache``).
* ``gateway.metrics``: the Prometheus metrics of every request.
* ``gateway.task_store``: async task records (``TaskStore``: memory;
  ``gateway.redis_task_store``: Redis; ``gateway.task_store_registry``: the
  store a URL names); ``gateway.task_runner``: runs tasks in the background over
  a store (``TaskRunner``); ``gateway.task_run``: one task's attempts
  (``TaskRun``) and the hooks its work reports through (``TaskHooks``).

HTTP: ``gateway.http`` (OpenAI-compatible routes, the task routes, health, readiness,
metrics and version, served by uvicorn in the gateway's event loop).

gRPC: ``gateway.server`` (the servicer, ``start_gateway``), ``gateway.task_api``
(its task RPCs), ``gateway.proto_convert`` (plain data ↔ messages),
``gateway.mesh_client`` (Scheduler and Executor calls), ``gateway.readiness``.

Per choice, the core chains the detokenizer and the stop strings::

    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    stops = StopStringMatcher(params.stop)
    for ids in executor_stream:
        text, match = stops.feed(detok.add(ids))
        ...  # send text; on a match cancel Execute, finish_reason "stop"
    text, match = stops.feed(detok.finish())
    text += stops.flush() if match is None else ""
"""
