"""Engine configuration: frozen dataclasses grouped by concern, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: memory for K and V of all layers (bytes); the number
            of blocks is ``kv_cache_memory_bytes // KVLayout.block_bytes``.
        num_blocks: an explicit number of blocks (overrides the memory budget; tests).
        enable_prefix_caching: reuse the KV of full blocks whose chain hash matches
            (``meshserve.block_hash``); freed cached blocks stay reusable until evicted.
        enable_kv_events: record the block pool's stored/removed events
            (``LLMEngine.take_kv_events``) for prefix-aware routing.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


PREFILL_ORDERS = ("shortest", "arrival")  # BatchSchedulerConfig.prefill_order


@dataclass(frozen=True)
class BatchSchedulerConfig:
    """The iteration-level batch scheduler.

    Attributes:
        max_num_seqs: most requests in one step's batch.
        max_num_batched_tokens: most tokens in one step's batch (the token budget).
        enable_chunked_prefill: split prompts over steps to fit the budget; when
            off, a prompt longer than ``max_num_batched_tokens`` is rejected.
        max_batch_wait_ms: dynamic batching wait (milliseconds, >= 0): while the
            running batch is small, a new prefill may be held up to this long so
            that it starts together with others; never longer. 0 = never hold.
        long_prefill_token_threshold: most prompt tokens one request computes in a
            step (vLLM's ``long_prefill_token_threshold``; 0 = no cap beyond the
            budget). A long prefill then runs in chunks of this size, so a step it
            shares with decodes and short prefills (prefix-cache hits) stays short;
            a request alone in the engine is not capped. Needs chunked prefill.
        short_prefill_tokens: short prefills first: a step first takes the prefills
            with at most this many tokens left to compute (prefix-cache hits' tails,
            short prompts); when it took any, longer prefills of no higher priority
            sit out the step (each at most ``MAX_PREFILL_DEFERRALS`` steps in all;
            ``executor.engine.prefill_order``). 0: off.
        prefill_order: the order a step visits the waiting requests in, within a
            priority: "shortest" (the default): the fewest tokens to compute first, a
            request passed over by later arrivals at most ``MAX_PREFILL_DEFERRALS``
            steps (``executor.engine.prefill_order.shortest_first``); "arrival": FCFS,
            as vLLM's ``fcfs`` policy.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_batch_wait_ms: float = 0.0
    long_prefill_token_threshold: int = 0
    short_prefill_tokens: int = 64
    prefill_order: str = "shortest"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0 <= self.max_batch_wait_ms < float("inf"):
            raise ValueError(f"max_batch_wait_ms must be a finite number >= 0, got {self.max_batch_wait_ms}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.short_prefill_tokens < 0:
            raise ValueError(f"short_prefill_tokens must be >= 0, got {self.short_prefill_tokens}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, got {self.prefill_order!r}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs chunked prefill (it splits prompts into chunks)")


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes one model replica spans (``executor.worker.multiproc_group``).

    Attributes:
        tensor_parallel_size: ranks that shard every layer (heads, MLP, vocabulary).
        pipeline_parallel_size: stages the layers are split into.
        rank_timeout_s: a collective that waits longer than this for another rank
            (seconds) fails the step: a hung rank takes the executor out.
        startup_timeout_s: the ranks must have loaded their shards within this (seconds).
        step_log_dir: each rank appends what it ran in each step (step id, ordered
            request ids and token counts per micro-batch) to ``rank-<r>.jsonl`` here
            (``executor.worker.step_log``); None: no step log.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    rank_timeout_s: float = 60.0
    startup_timeout_s: float = 600.0
    step_log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"tensor- and pipeline-parallel sizes must be >= 1, got "
                             f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}")
        if not self.rank_timeout_s > 0 or not self.startup_timeout_s > 0:
            raise ValueError("rank_timeout_s and startup_timeout_s must be > 0")

    @property
    def world_size(self) -> int:
        """Processes of the replica: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    """Everything an ``LLMEngine`` needs.

    Attributes:
        model: ``--model`` as ``meshserve.model_files.resolve_model`` takes it.
        dtype: ``auto`` (float32 on CPU), ``float32``, ``bfloat16`` or ``float16``.
        max_model_len: cap on prompt + output tokens (default: the model's limit).
        num_threads: ``torch.set_num_threads`` for the engine (default: torch's).
        cache: KV cache settings.
        batch: batch scheduler settings.
        seed: seed of the generator shared by unseeded sampled requests.
        attention_backend: ``auto`` (``triton`` on CUDA when installed, else ``torch``)
            or a registered attention backend name.
        device: torch device of the model and cache (``cuda``: rank ``r`` of a
            parallel group uses ``cuda:r``).
        parallel: tensor and pipeline parallel sizes (1 and 1: one in-process worker).
        revision: ``--revision`` of a Hugging Face model id (None: ``main``).
        cuda_graphs: replay pure-decode steps from CUDA graphs captured at start-up per
            batch-size bucket (``executor.worker.cuda_graphs``). None: wherever they can
            run (one CUDA device, the triton backend); True elsewhere is ignored with
            a log line; False: always eager.
        compile: run decode-only steps through ``torch.compile``, compiled at start-up
            per decode batch-size bucket (``executor.worker.compiled_decode``; CPU,
            float32, one thread, one rank: elsewhere the engine logs why and stays eager).
        warm_up: run one full step of prompt tokens through the model at start-up
            (``LLMEngine.warm_up``), so that the first full steps after it do not pay for
            memory the process touches for the first time. The executor's CLI and the
            bench's engine target turn it on; off here so that library users and tests
            that build many engines pay nothing for it.
    """

    model: str = "default"
    dtype: str = "auto"
    max_model_len: int | None = None
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    batch: BatchSchedulerConfig = field(default_factory=BatchSchedulerConfig)
    seed: int = 0
    attention_backend: str = "auto"
    device: str = "cpu"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    revision: str | None = None
    cuda_graphs: bool | None = None
    compile: bool = False
    warm_up: bool = False

    def __post_init__(self) -> None:
        """Checks what can be checked before the model loads.

        Raises:
            ValueError: bad num_threads, dtype, device or attention backend.
        """
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"device must be a torch device such as cpu, cuda or cuda:1, got {self.device!r}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: CUDA is not available on this machine")
        from executor.attention.registry import resolve_backend_name

        resolve_backend_name(self.attention_backend, device)
