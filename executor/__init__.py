"""executor: one model replica behind the ``Executor`` gRPC service.

Map of the package (one concept per module)::

    server.py                 the gRPC servicer (thin: proto <-> engine)
    engine/
      async_engine.py         AsyncEngine: LLMEngine.step() in one background thread; n > 1 choices
      choices.py              the choices' output streams merged into one (bounded)
      llm_engine.py           LLMEngine: schedule() -> execute_model() -> update_from_output()
      config.py               CacheConfig, BatchSchedulerConfig, EngineConfig
      request.py, stop.py     CheckedRequest, Request and its statuses; stop conditions
      batch_scheduler.py      continuous batching, chunked prefill, preemption
      kv_cache_manager.py     per-request block lists
      block_pool.py           free list and reference counts of physical blocks
      scheduler_output.py     SchedulerOutput / ModelRunnerOutput (between the three calls)
      model_runner.py         flattened batch -> forward -> logits -> sampler
      kv_cache.py             sizing and allocating the paged K/V tensors
      sampler.py              penalties, min_tokens, greedy, temperature, min-p, top-k, top-p, seeded generators
      logprobs.py             sampled and prompt logprobs (raw log_softmax, top-k)
      outputs.py              RequestOutput, EngineStats
    attention/                AttentionMetadata, backend ABC + registry, torch backend, layer
    models/                   our Llama-family model and its tensor-parallel layers
    model_loader.py           config + safetensors -> our model

Data flow of one step: the batch scheduler picks token shares per request and
allocates their KV slots; the model runner flattens those tokens into one
unpadded batch with ``positions``, ``slot_mapping`` and ``block_table``; every
attention layer writes its new K/V into the paged cache and attends through the
backend; logits are computed only at each sampling request's last token; the
scheduler appends the sampled tokens, applies stop conditions and frees the
blocks of finished requests.
"""
