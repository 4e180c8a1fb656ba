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

A tensor/pipeline-parallel group (``executor.worker.multiproc_group``) holds one
worker per rank, each with its shard of the weights and its KV heads of its
stage's layers, running the same calls on the same plain data (a stage runs
``executor.worker.pipeline.PipelineModelRunner``); only rank 0 samples, and a
saved block is gathered from every rank's heads and layers on rank 0
(``kv_connector.assemble_blocks``).
"""

from __future__ import annotations

import logging

import torch

from executor.attention import cpu_kernel, cpu_prefill_kernel
from executor.attention.registry import resolve_backend_name
from executor.engine.config import EngineConfig
from executor.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from executor.engine.worker_group import ModelSpec
from executor.model_loader import load_model
from executor.models import cpu_decoder_stack, cpu_fused
from executor.models.checkpoint import checkpoint_num_params
from executor.models.parallel import COMM, SINGLE, TensorParallel
from executor.worker import compiled_decode
from executor.worker.cuda_graphs import CUDAGraphRunner, graph_batch_sizes, graphs_off_reason
from executor.worker.distributed import rank_device
from executor.worker.kv_cache import allocate_kv_storage, layer_views
from executor.worker.kv_connector import KVConnectorWorker, assemble_blocks, block_payloads
from executor.worker.model_runner import ModelRunner
from executor.worker.pipeline import PipelineModelRunner
from executor.worker.step_log import StepLog
from meshserve.model_files import resolve_model

log = logging.getLogger(__name__)


class Worker:
    """Loads the model of ``config`` on ``config.device``; the KV cache comes with
    ``initialize_cache``.

    Args:
        config: the engine's configuration (model, dtype, max_model_len, threads,
            attention backend, device, sampler seed, parallel sizes).
        rank: this worker's rank in ``config.parallel`` (its tensor-parallel rank;
            rank 0 samples). A group of more than one rank needs the process group
            set up before the first ``execute_model``, not before construction.

    Raises:
        FileNotFoundError: the model cannot be resolved.
        ValueError: bad dtype or max_model_len, or an unsupported architecture.
    """

    def __init__(self, config: EngineConfig, rank: int = 0):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.rank = rank
        size, stages = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        self.stage, tp_rank = divmod(rank, size)
        self.num_stages = stages
        ranks = tuple(self.stage * size + t for t in range(size)) if stages > 1 else None
        self.tp = TensorParallel(tp_rank, size, ranks) if size > 1 else SINGLE
        parallel = size * stages > 1
        self.device = torch.device(rank_device(config.device, rank) if parallel else config.device)
        files = resolve_model(config.model, config.revision)
        self.loaded = load_model(files.path, dtype=config.dtype, max_model_len=config.max_model_len,
                                 attention_backend=resolve_backend_name(config.attention_backend, self.device),
                                 device=self.device, tp=self.tp, pp_rank=self.stage, pp_size=stages)
        layers = self.loaded.model.attention_layers()
        hf = self.loaded.hf_config
        num_kv_heads = int(hf.num_key_value_heads)  # the model's, before sharding
        self.kv_heads = (self.tp.kv_head_start(num_kv_heads), num_kv_heads)  # (this rank's first, total)
        self.kv_layers = (self.loaded.model.first_layer, int(hf.num_hidden_layers))  # (this stage's first, total)
        if self.device.type == "cpu" and torch.get_num_threads() == 1:
            cpu_kernel.load()  # build (or load) the CPU decode kernel now, not in the first request's step
            cpu_fused.load()  # and the fused norm/rotary/SiLU kernels
            cpu_decoder_stack.load()  # and the driver running the layers of decode-kernel steps in one call
            if self.loaded.dtype == torch.bfloat16:
                cpu_prefill_kernel.load()  # and the bfloat16 prefill-attention kernel
        self.spec = ModelSpec(
            model_id=files.model_id, revision=files.revision, dtype=str(self.loaded.dtype).removeprefix("torch."),
            num_layers=int(hf.num_hidden_layers), num_kv_heads=num_kv_heads, head_dim=layers[0].head_dim,
            vocab_size=self.loaded.vocab_size, max_model_len=self.loaded.max_model_len,
            eos_token_ids=self.loaded.eos_token_ids,
            num_params=sum(p.numel() for p in self.loaded.model.parameters()) if not parallel
            else checkpoint_num_params(files.path, self.loaded.model.tie_word_embeddings))
        self.kv_caches: list = []
        self.model_runner: ModelRunner | None = None
        self.kv_connector: KVConnectorWorker | None = None
        self.num_steps = 0  # execute_model calls: the step id when the caller gives none
        self.step_log = StepLog(config.parallel.step_log_dir, rank, self.stage) if config.parallel.step_log_dir \
            else None
        embed = self.loaded.model.embed_tokens
        if rank == 0 and embed is not None and self.tp.world_size > 1:
            padded = embed.rows_per_rank * self.tp.world_size
            log.info("vocabulary of %d tokens padded to %d for %d tensor-parallel ranks: %d rows per rank, "
                     "%d padding rows on the last", embed.num_embeddings, padded, self.tp.world_size,
                     embed.rows_per_rank, padded - embed.num_embeddings)

    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocates the zero-filled KV cache of ``num_blocks`` blocks and binds each
        attention layer to its ``(key_cache, value_cache)`` views; with CUDA graphs
        (``executor.worker.cuda_graphs``), one block more for padded decode rows, and
        captures the graphs.

        Raises:
            RuntimeError: the cache is already allocated, or the device is out of memory.
        """
        if self.model_runner is not None:
            raise RuntimeError("the KV cache is already allocated")
        spec = self.spec
        layers = self.loaded.model.attention_layers()
        off = graphs_off_reason(self.config.cuda_graphs, self.device.type, layers[0].backend,
                                self.config.parallel.world_size)
        if off is not None and (self.config.cuda_graphs or self.device.type == "cuda"):  # asked for, or on CUDA
            log.info("CUDA graphs off: %s; every step runs eagerly", off)
        # with graphs, one more block than the engine's pool: the one padded decode rows use
        storage = allocate_kv_storage(len(layers), num_blocks + (off is None), block_size, layers[0].num_kv_heads,
                                      spec.head_dim, self.loaded.dtype, self.device)  # this rank's KV heads only
        self.kv_caches = layer_views(storage)
        for layer, kv_cache in zip(layers, self.kv_caches):
            layer.kv_cache = kv_cache
        self.kv_connector = KVConnectorWorker(storage, layers=self.kv_layers, kv_heads=self.kv_heads)
        if self.num_stages > 1:
            self.model_runner = PipelineModelRunner(self.loaded, block_size, self.config.seed, self.device,
                                                    self.rank == 0, self.rank, self.tp.world_size, self.num_stages)
        else:
            graphs = None if off is not None else CUDAGraphRunner(
                self.loaded.model, layers[0].backend, graph_batch_sizes(self.config.batch.max_num_seqs), block_size,
                self.loaded.max_model_len, padding_block=num_blocks, device=self.device)
            self.model_runner = ModelRunner(self.loaded, block_size, self.config.seed, self.device,
                                            driver=self.rank == 0, graphs=graphs)
            if graphs is not None:
                try:
                    graphs.capture_all()
                except RuntimeError as err:  # an op CUDA refuses to capture: serve eagerly rather than not at all
                    log.warning("CUDA graph capture failed (%s); every step runs eagerly", err)
                    self.model_runner.graphs = None
        if self.config.compile:
            self._compile_decode(block_size)

    def _compile_decode(self, block_size: int) -> None:
        """Compiles the decode steps per batch-size bucket now, in the start-up
        (``executor.worker.compiled_decode``), or logs why they stay eager here."""
        model = self.loaded.model
        reason = compiled_decode.unavailable_reason(model, self.device, self.loaded.dtype,
                                                    self.config.parallel.world_size)
        if reason is not None:
            log.warning("--compile ignored: %s; decode steps run eagerly", reason)
            return
        log.info("compiling decode steps (inductor cache %s)", compiled_decode.inductor_cache_dir())
        buckets = compiled_decode.decode_buckets(self.config.batch.max_num_seqs)
        compiled = compiled_decode.CompiledDecode(model, block_size, self.loaded.max_model_len, buckets)
        try:
            compiled.warm_up()
        except Exception as err:  # noqa: BLE001 - any compiler failure (no C++ compiler, an inductor error): eager
            log.warning("--compile failed (%s: %s); decode steps run eagerly", type(err).__name__, err)
            return
        self.model_runner.compiled_decode = compiled

    def execute_model(self, scheduler_output: SchedulerOutput, step_id: int | None = None) -> ModelRunnerOutput:
        """One step (see the module doc); ``step_id`` names it in the step log (rank 0's
        count, sent with the step; None: this worker's own count).

        Raises:
            RuntimeError: ``initialize_cache`` was not called.
        """
        if self.model_runner is None:
            raise RuntimeError("initialize_cache must be called before execute_model")
        if scheduler_output.kv_loads:
            self.kv_connector.load_kv(scheduler_output.kv_loads)
        output = self.model_runner.execute_model(scheduler_output)
        self.num_steps += 1
        if self.step_log is not None and self.model_runner.last_micro_batches:
            self.step_log.record(self.num_steps if step_id is None else step_id, self.model_runner.last_micro_batches)
        if scheduler_output.kv_saves:
            block_ids = [save.block_id for save in scheduler_output.kv_saves]
            if self.tp.world_size * self.num_stages == 1:
                output.kv_saved = self.kv_connector.save_kv(block_ids)
            else:
                output.kv_saved = self._gather_saved(block_ids)
        return output

    def _gather_saved(self, block_ids: list[int]) -> list[bytes]:
        """Whole-model payloads of ``block_ids`` on rank 0, from every rank's layers and
        KV heads (a gather to rank 0); an empty list on the other ranks."""
        local = self.kv_connector.save_local(block_ids, to_cpu=False)
        COMM.all_gather_bytes += local.numel() * local.element_size()
        if self.num_stages == 1:  # equal shapes: a tensor gather
            parts = [torch.empty_like(local) for _ in range(self.tp.world_size)] if self.rank == 0 else None
            torch.distributed.gather(local, parts, dst=0)
            layer_starts = [0] * self.tp.world_size
            head_starts = [TensorParallel(r, self.tp.world_size).kv_head_start(self.kv_heads[1])
                           for r in range(self.tp.world_size)]
        else:  # stages may hold different numbers of layers
            gathered = [None] * torch.distributed.get_world_size() if self.rank == 0 else None
            torch.distributed.gather_object((local.cpu(), self.kv_layers[0], self.kv_heads[0]), gathered, dst=0)
            if self.rank == 0:
                parts, layer_starts, head_starts = zip(*gathered)
        if self.rank != 0:
            return []
        return block_payloads(assemble_blocks([p.cpu() for p in parts], layer_starts, head_starts))
