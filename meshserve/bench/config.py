"""What one ``meshserve bench`` run measures, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.bench.workload import WorkloadSpec

TARGETS = ("engine", "mesh", "hf-generate")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run.

    Attributes:
        target: "engine" (in-process AsyncEngine), "mesh" (the launched mesh, or
            the gateway at ``addr``) or "hf-generate" (transformers ``generate``).
        concurrency: requests in flight (closed loop); hf-generate always runs 1.
        workload: the measured requests' spec (count, seed, length distributions).
        warmup: unmeasured warm-up requests run first.
        model: model alias or path (``meshserve.model_files.resolve_model``).
        dtype: "auto", "float32" or "bfloat16".
        kv_cache_memory: KV cache budget of the engine / each executor ("1GiB").
        max_num_seqs / max_num_batched_tokens: the engine's batch limits.
        executors: executor processes of a launched mesh.
        addr: host:port of a running gateway (mesh target only; None: launch one).
        num_threads: torch CPU threads of the engine, of each launched executor and of
            hf-generate (None: ``meshserve.launcher.default_threads_per_executor``), so
            every target computes on the same cores.
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

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if min(self.concurrency, self.executors) < 1 or self.warmup < 0:
            raise ValueError("concurrency and executors must be >= 1, warmup >= 0")
        from meshserve.services import parse_bytes

        parse_bytes(self.kv_cache_memory)  # ValueError names the bad size
        if self.addr is not None and self.target != "mesh":
            raise ValueError("--addr applies to the mesh target only")

    @property
    def threads(self) -> int:
        """The torch threads every target uses."""
        from meshserve.launcher import default_threads_per_executor

        return self.num_threads or default_threads_per_executor(self.executors)

    @property
    def effective_concurrency(self) -> int:
        """The concurrency actually run: hf-generate serves one request at a time."""
        return 1 if self.target == "hf-generate" else self.concurrency
