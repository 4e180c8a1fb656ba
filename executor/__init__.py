"""executor: one model replica behind the ``Executor`` gRPC service.

Map of the package (one concept per module)::

    server.py                 the gRPC servicer (thin: proto <-> engine; a request checked once) and the scheduler link
    health.py                 StepWatchdog: a dead or wedged engine turns the executor NOT_SERVING
    kvstore_connector.py      KVStoreConnector: the kvstore I/O (gRPC on its own thread)
    kv_events.py              prefix-cache events -> batches of chain hashes for the scheduler's router
    request_span.py           the spans of one Execute call
    metrics.py                the Prometheus metrics, read from the engine's counters
    model_loader.py           config + safetensors -> our model
    parallel_layout.py        the tensor/pipeline-parallel sizes a model allows (config.json only)
    engine/                   the scheduling side: no tensor, no weights
      async_engine.py         AsyncEngine: LLMEngine.step() in one background thread; n > 1 choices
      choices.py              the choices' output streams merged into one (bounded)
      llm_engine.py           LLMEngine: schedule() -> execute_model() -> update_from_output()
      worker_group.py         WorkerGroup ABC + ModelSpec: the one interface to the model side
      config.py               CacheConfig, BatchSchedulerConfig, EngineConfig
      request.py, stop.py     CheckedRequest, Request and its statuses; stop conditions
      batch_scheduler.py      continuous batching, chunked prefill, preemption
      kv_cache_manager.py     per-request block lists and chain hashes
      block_pool.py           free list and reference counts of physical blocks
      kv_connector.py         KV transfer: the store I/O ABC and the scheduler half (fetch/load/publish)
      scheduler_output.py     SchedulerOutput / ModelRunnerOutput (plain, picklable data)
      outputs.py              RequestOutput, EngineStats, KVConnectorStats
    worker/                   the model side
      group.py                InProcessWorkerGroup: one Worker in this process
      worker.py               Worker: weights, KV cache tensors, execute_model
      model_runner.py         flattened batch -> forward -> logits -> sampler
      kv_cache.py             allocating the paged K/V tensors
      kv_connector.py         KV transfer, worker half: block bytes in and out of the cache
      sampler.py              min_tokens, logit bias, penalties, greedy, temperature, min-p/top-k/top-p, seeded rows
      logprobs.py             sampled and prompt logprobs (raw log_softmax, top-k)
    attention/                AttentionMetadata, backend ABC + registry, torch and Triton backends, layer
    models/                   our Llama-family model and its tensor-parallel layers

Data flow of one step: the batch scheduler picks token shares per request and
allocates their KV slots; the worker group gets that plan as plain data and its
model runner flattens those tokens into one unpadded batch with ``positions``,
``slot_mapping`` and ``block_table``; every attention layer writes its new K/V
into the paged cache and attends through the backend; logits are computed only
at each sampling request's last token; the scheduler appends the sampled
tokens, applies stop conditions and frees the blocks of finished requests.
"""
