"""Decode steps through ``torch.compile``, batch sizes bucketed (opt-in: ``--compile``).

What it removes: on one CPU thread a decode step of SmolLM2-135M is ~300 ms, ~200 of
them oneDNN GEMMs and ~45 the C attention kernel; the ~19 ms of Python between the
ops (module calls, shape checks, ``ctypes`` marshalling) is what compiling can take
away. So the whole decoder stack becomes one graph (``fullgraph=True``): the C kernels
are torch operators there (``cpu_fused``'s norm, rotary and SiLU-and-multiply,
``cpu_kernel.padded_decode_attention`` for the cache write and the attention), as C++
operators (``executor.models.cpu_ops``) where they can be built, else as the Python
custom ops (``cpu_kernel.TRACED_OPS`` says which the tracer records), the
packed GEMMs are the ``mkldnn._linear_pointwise`` ops inductor itself emits (called as
the aten op: inductor's own lowering of it wants the weight frozen into the graph).
The numbers are those of the eager path: the same kernels in the same order, and the
GEMMs are batch-invariant, so padding rows change no real row (greedy tokens equal).

Measured (``python -m meshserve.bench.compiled_decode``; reports/cpu-speed/compile.md):
with the C++ operators 1.04-1.09x the eager step at 32 decodes and 1.15-1.18x at one,
hidden states bitwise equal; with the Python custom ops 0.88-1.02x (each costs ~20 µs
more a call than the eager path's ``ctypes`` call). It moves minutes of compilation
into the start, so it stays opt-in, off by default.

Shapes: a compiled graph has fixed shapes, so a decode-only step of ``n`` requests is
padded to the smallest bucket ``>= n`` (``decode_buckets``: powers of two up to
``max_num_seqs``). Padding rows keep the token ids and positions of an earlier step
(zeros at first: always valid), are neither written to the cache nor attended
(``num_valid``, a tensor so that one graph serves any fill; their attention output is
zero), and their outputs are dropped. The block table is padded to ``max_model_len /
block_size`` columns. Steps with a prefill chunk, and decode batches above the largest
bucket, run eagerly.

Start-up: ``warm_up`` compiles every bucket in the worker's start, not on the first
requests; inductor's caches (FX graph, AOTAutograd, the C++ builds) go under
``$MESHSERVE_CACHE_DIR/inductor`` (``TORCHINDUCTOR_CACHE_DIR`` wins when set), so a
second start skips code generation and compilation (Dynamo still traces each bucket).

Where it runs: CPU, float32, torch on one thread, one rank, the torch attention
backend with the C kernels built; elsewhere ``unavailable_reason`` says why and the
engine stays eager.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.attention import AttentionMetadata, cpu_kernel
from executor.attention.torch_backend import TorchAttentionBackend
from executor.attention.torch_plan import PaddedDecodePlan
from executor.models import cpu_fused, cpu_gemm, cpu_ops
from meshserve.model_files import cache_dir

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {"cpp_wrapper": False}
"""Inductor options of the compiled decode graph. The Python wrapper, not the C++ one:
on SmolLM2-135M at 32 decodes both measured 1.09x the eager step (with the C++
operators), and the C++ wrapper took ~5x as long to compile (a 370 kB C++ file per
bucket; reports/cpu-speed/compile.md)."""


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes compiled for: powers of two below ``max_num_seqs``, then
    ``max_num_seqs`` itself (``64`` → ``(1, 2, 4, 8, 16, 32, 64)``, ``48`` → ``(1, ..., 32, 48)``).

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return (*buckets, max_num_seqs)


def bucket_for(num_decodes: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket ``>= num_decodes`` (``buckets`` ascending), or None when the
    batch is larger than every bucket (or empty)."""
    if num_decodes < 1:
        return None
    for size in buckets:
        if size >= num_decodes:
            return size
    return None


_USER_INDUCTOR_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
"""The user's choice, read at import: inductor writes its own default (``/tmp/torchinductor_*``)
into the variable the first time anything in the process asks for its cache folder."""


def operators_key() -> str:
    """A hash of the sources that define the graph's own operators (their schemas and
    kernels: ``cpu_ops.cpp``, ``cpu_kernel.py``, ``cpu_fused.py``, ``cpu_gemm.py``).
    Inductor's caches do not key a compiled graph by a custom operator's schema, so a
    graph cached before an operator changed would be loaded again; the cache folder is
    named by this key."""
    digest = hashlib.sha256()
    for path in (cpu_ops.SOURCE, cpu_kernel.__file__, cpu_fused.__file__, cpu_gemm.__file__):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def inductor_cache_dir() -> str:
    """Points inductor's on-disk caches at ``$MESHSERVE_CACHE_DIR/inductor/<operators_key()>``
    unless the user set ``TORCHINDUCTOR_CACHE_DIR``; returns the folder in use. Call it
    before the compilations (inductor reads the variable whenever it looks for its cache).
    A value equal to inductor's own default counts as unset: inductor may have written it
    into the environment before this module was imported (seen in ``meshserve bench``)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    user = _USER_INDUCTOR_CACHE_DIR
    if user and os.path.abspath(user) == os.path.abspath(default_cache_dir()):
        user = None
    directory = user or str(cache_dir() / "inductor" / operators_key())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    return directory


def unavailable_reason(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                       world_size: int) -> str | None:
    """Why the compiled decode path cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"compiled decode is for CPU; device is {device}"
    if world_size != 1:
        return "compiled decode runs one rank; this replica has several"
    if dtype != torch.float32:
        return f"compiled decode runs float32; the model is {dtype}"
    if torch.get_num_threads() != 1:
        return f"compiled decode needs torch on one thread (its C kernels run one); it runs {torch.get_num_threads()}"
    if not isinstance(model.attention_layers()[0].backend, TorchAttentionBackend):
        return "compiled decode needs the torch attention backend"
    if cpu_kernel.load() is None or cpu_fused.load() is None:
        return "compiled decode needs the C kernels, which could not be built here (see the log)"
    return None


@dataclass
class _Bucket:
    """One bucket's inputs, filled in place every step (the compiled graph's guards
    see the same objects every time)."""

    size: int
    input_ids: torch.Tensor          # (size,) int64
    positions: torch.Tensor          # (size,) int64
    md: AttentionMetadata            # slot_mapping (size,), block_table (size, width), seq_lens (size,)
    num_valid: torch.Tensor          # 0-dim int64, md.plan.num_valid


class CompiledDecode:
    """The model's forward for decode-only steps, compiled once per bucket.

    Args:
        model: a loaded ``LlamaForCausalLM`` whose caches are bound (``unavailable_reason`` None).
        block_size: tokens per KV block.
        max_model_len: longest sequence (tokens): the padded block table's width.
        buckets: ascending decode batch sizes to compile (``decode_buckets``).
        options: inductor options (default ``INDUCTOR_OPTIONS``).
    """

    def __init__(self, model: torch.nn.Module, block_size: int, max_model_len: int, buckets: tuple[int, ...],
                 options: dict | None = None):
        self.model = model
        self.buckets = buckets
        self.cpp_ops = cpu_ops.load()  # the C kernels as C++ operators: no Python per op in the graph
        cpu_kernel.TRACED_OPS = torch.ops.meshserve_cpu if self.cpp_ops else torch.ops.meshserve
        self.width = -(-max_model_len // block_size)
        self._buckets = {size: self._make_bucket(size, block_size) for size in buckets}
        options = dict(INDUCTOR_OPTIONS if options is None else options)
        self._compiled = torch.compile(self._run, fullgraph=True, dynamic=False, options=options)
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds its warm-up took
        self.steps = 0  # decode steps run through the compiled graphs

    def _make_bucket(self, size: int, block_size: int) -> _Bucket:
        zeros32 = torch.zeros(size, dtype=torch.int32)
        num_valid = torch.zeros((), dtype=torch.int64)
        md = AttentionMetadata(num_reqs=size, num_tokens=size, num_decodes=size, max_query_len=1, max_seq_len=1,
                               block_size=block_size, query_start_loc=torch.arange(size + 1, dtype=torch.int32),
                               seq_lens=zeros32.clone(), num_computed_tokens=zeros32.clone(),
                               slot_mapping=torch.zeros(size, dtype=torch.int64),
                               block_table=torch.zeros(size, self.width, dtype=torch.int32),
                               query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[1] * size,
                               num_computed_tokens_cpu=[0] * size, plan=PaddedDecodePlan(num_valid))
        return _Bucket(size, torch.zeros(size, dtype=torch.int64), torch.zeros(size, dtype=torch.int64), md,
                       num_valid)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, md)

    def warm_up(self) -> None:
        """Compiles every bucket (or loads it from the on-disk cache): one padded decode
        of one request at position 0 writing slot 0 of the cache, harmless before any
        request is served (the block pool gives out no block's contents unwritten).
        Records the seconds each bucket took in ``compile_seconds``."""
        with torch._dynamo.config.patch(recompile_limit=max(8, 2 * len(self.buckets))), torch.inference_mode():
            for size in self.buckets:
                b = self._buckets[size]
                b.num_valid.fill_(1)
                b.md.seq_lens[0] = 1
                start = time.perf_counter()
                self._compiled(b.input_ids, b.positions, b.md)
                self.compile_seconds[size] = time.perf_counter() - start
        log.info("compiled decode buckets %s in %.1f s (inductor cache %s)", list(self.buckets),
                 sum(self.compile_seconds.values()), os.environ.get("TORCHINDUCTOR_CACHE_DIR"))

    def handles(self, md: AttentionMetadata) -> bool:
        """Whether this step is decode-only, fits a bucket and the padded block table."""
        return (md.num_decodes == md.num_reqs and bucket_for(md.num_reqs, self.buckets) is not None
                and md.block_table.shape[1] <= self.width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The model's forward of a step ``handles`` accepts: ``(num_reqs, hidden_size)``
        final-normed hidden states, as ``model(input_ids, positions, md)`` gives."""
        n = md.num_reqs
        b = self._buckets[bucket_for(n, self.buckets)]
        b.input_ids[:n] = input_ids
        b.positions[:n] = positions
        b.md.slot_mapping[:n] = md.slot_mapping
        b.md.block_table[:n, : md.block_table.shape[1]] = md.block_table
        b.md.seq_lens[:n] = md.seq_lens
        b.num_valid.fill_(n)
        self.steps += 1
        return self._compiled(b.input_ids, b.positions, b.md)[:n]
