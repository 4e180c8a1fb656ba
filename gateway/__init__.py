"""meshserve gateway: the public API in front of the mesh.

Pure core (no gRPC, unit-tested directly):

* ``gateway.tenants``: API key -> ``Tenant`` (``TenantRegistry``).
* ``gateway.prompt``: raw text / chat messages / token ids -> prompt ids
  (``PromptBuilder``), with the chat template and the special-token policy.
* ``gateway.detokenizer``: output ids -> UTF-8-safe text pieces
  (``IncrementalDetokenizer``).
* ``gateway.stop_strings``: cuts streamed text at stop strings
  (``StopStringMatcher``).
* ``gateway.choices``: one detokenizer + stop-string matcher + counts per choice
  of an ``n`` > 1 request (``Choice``).
* ``gateway.collector``: a Generate stream -> finished choices, and back
  (``ChoiceCollector``, ``replay``): a task's result, a result-cache entry.
* ``gateway.result_cache``: outputs of deterministic requests (``ResultCache``).
* ``gateway.task_store``: async task records (``TaskStore``: memory;
  ``gateway.redis_task_store``: Redis; ``gateway.task_store_registry``: the
  store a URL names); ``gateway.task_runner``: runs tasks in the background over
  a store (``TaskRunner``).

gRPC layer: ``gateway.server`` (the servicer) and ``gateway.task_api`` (its
task RPCs).

Per request, the servicer chains the last two::

    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    stops = StopStringMatcher(params.stop)
    for ids in executor_stream:
        text, match = stops.feed(detok.add(ids))
        ...  # send text; on a match cancel Execute, finish_reason "stop"
    text, match = stops.feed(detok.finish())
    text += stops.flush() if match is None else ""
"""
