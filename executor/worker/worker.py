"""Worker: one model on one device, with its paged KV cache.

The worker owns everything with a tensor in it: the weights (``load_model``),
the one KV cache allocation (``executor.worker.kv_cache``), the model runner
(forward pass and sampling, with the per-request seeded generators) and the
worker half of KV transfer (block bytes in and out of the cache). It runs one
step per ``execute_model`` call on plain data and never sees a ``Request``::

    execute_model(SchedulerOutput)
      1. kv_loads  → KVConnectorWorker.load_kv   (fetched prefix blocks)
      2. scheduled → ModelRunner.execute_model   (forward, logits, sampling)
      3. kv_saves  → KVConnectorWorker.save_kv   (computed blocks to publish)
      → ModelRunnerOutput

A tensor-parallel group will hold one worker per rank, each with its shard of
the weights and KV heads, behind the same calls.
"""

from __future__ import annotations

import logging

import torch

from executor.attention import cpu_kernel
from executor.attention.registry import resolve_backend_name
from executor.engine.config import EngineConfig
from executor.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from executor.engine.worker_group import ModelSpec
from executor.model_loader import load_model
from executor.worker.kv_cache import allocate_kv_storage, layer_views
from executor.worker.kv_connector import KVConnectorWorker
from executor.worker.model_runner import ModelRunner
from meshserve.model_files import resolve_model

log = logging.getLogger(__name__)


class Worker:
    """Loads the model of ``config`` on ``config.device``; the KV cache comes with
    ``initialize_cache``.

    Args:
        config: the engine's configuration (model, dtype, max_model_len, threads,
            attention backend, device, sampler seed).

    Raises:
        FileNotFoundError: the model cannot be resolved.
        ValueError: bad dtype or max_model_len, or an unsupported architecture.
    """

    def __init__(self, config: EngineConfig):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        files = resolve_model(config.model)
        self.loaded = load_model(files.path, dtype=config.dtype, max_model_len=config.max_model_len,
                                 attention_backend=resolve_backend_name(config.attention_backend, self.device),
                                 device=self.device)
        layers = self.loaded.model.attention_layers()
        if self.device.type == "cpu" and torch.get_num_threads() == 1:
            cpu_kernel.load()  # build (or load) the CPU decode kernel now, not in the first request's step
        self.spec = ModelSpec(
            model_id=files.model_id, revision=files.revision, dtype=str(self.loaded.dtype).removeprefix("torch."),
            num_layers=len(layers), num_kv_heads=layers[0].num_kv_heads, head_dim=layers[0].head_dim,
            vocab_size=self.loaded.vocab_size, max_model_len=self.loaded.max_model_len,
            eos_token_ids=self.loaded.eos_token_ids,
            num_params=sum(p.numel() for p in self.loaded.model.parameters()))
        self.kv_caches: list = []
        self.model_runner: ModelRunner | None = None
        self.kv_connector: KVConnectorWorker | None = None

    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocates the zero-filled KV cache of ``num_blocks`` blocks and binds each
        attention layer to its ``(key_cache, value_cache)`` views.

        Raises:
            RuntimeError: the cache is already allocated, or the device is out of memory.
        """
        if self.model_runner is not None:
            raise RuntimeError("the KV cache is already allocated")
        spec = self.spec
        storage = allocate_kv_storage(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                                      self.loaded.dtype, self.device)
        self.kv_caches = layer_views(storage)
        for layer, kv_cache in zip(self.loaded.model.attention_layers(), self.kv_caches):
            layer.kv_cache = kv_cache
        self.kv_connector = KVConnectorWorker(storage)
        self.model_runner = ModelRunner(self.loaded, block_size, self.config.seed, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step (see the module doc).

        Raises:
            RuntimeError: ``initialize_cache`` was not called.
        """
        if self.model_runner is None:
            raise RuntimeError("initialize_cache must be called before execute_model")
        if scheduler_output.kv_loads:
            self.kv_connector.load_kv(scheduler_output.kv_loads)
        output = self.model_runner.execute_model(scheduler_output)
        if scheduler_output.kv_saves:
            output.kv_saved = self.kv_connector.save_kv([save.block_id for save in scheduler_output.kv_saves])
        return output
