"""The CPU paged decode-attention kernel (``cpu_paged_attention.c``): built once, cached
on disk, called through ``ctypes``.

Why a kernel: on CPU the torch backend's decode attention gathers every request's
blocks into a padded copy and runs SDPA over it, so each key and value is read,
written and read again; at 32 requests of ~150-280 tokens that was the largest
part of a SmolLM2-135M decode step on one AVX2 core, more than the matmuls
(``python -m meshserve.bench.step_profile``). The kernel reads each key and value once,
straight from the paged cache, with no padding and no mask.

Build: plain C with no torch headers, compiled by the system C compiler
(``$CC``, else ``cc``/``gcc``) with ``-O3 -march=native -ffast-math`` into
``$MESHSERVE_CACHE_DIR/kernels/`` (default ``~/.cache/meshserve/kernels/``),
named by a hash of the source, the compiler's version and this CPU's flags, so a
second start loads the cached library (about a millisecond) instead of
compiling (about a second). Where no compiler works, ``load`` returns ``None``
once, logs why, and the backend keeps its torch path: nothing else changes.
``MESHSERVE_CPU_ATTENTION_KERNEL=0`` turns the kernel off.

Where the CPU has AVX512-BF16 (Zen 4, Sapphire Rapids and later), a bfloat16 cache
takes a vectorised path (``vdpbf16ps`` dot products, 16 keys' sums reduced together,
values widened in registers): 2.3x the plain C path on one layer in cache and about
1.4x over 30 layers read from memory, on one Zen 4 core (``python -m
meshserve.bench.cpu_attention --dtype bfloat16 [--layers 30]``). Where it also has
AMX-BF16 (Sapphire Rapids and later) the scores are multiplied on AMX tiles
(``scores_on_amx``, logged at load): a prompt's token rows 1.6-1.8x as fast, decodes
1.07x (the C file's header has the figures).

The kernel runs on one thread; ``TorchAttentionBackend`` calls it only when torch
itself runs on one thread (more threads: SDPA, which parallelises).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from meshserve.model_files import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-shared", "-std=c11")
_lock = threading.Lock()
_loaded: dict[str, object] = {}
_UNSET = object()

TRACED_OPS = torch.ops.meshserve
"""The operators ``torch.compile`` records for the C kernels: the Python custom ops of
this module and ``cpu_fused`` (``meshserve::*``), or their C++ twins
(``torch.ops.meshserve_cpu``, ``executor.models.cpu_ops``) once those are built."""


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def cpu_flags() -> str:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (space-separated), or ``""``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def library_path(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the library built by ``compiler`` from ``source`` with ``flags`` for this CPU
    is cached (``kernels/<source stem>-<hash>.so``)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source.read_text(), version, cpu_flags(), *flags, *_LINK]).encode()
                         ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


_LINK = ("-shared", "-lm")
"""The link step's flags: none of the compile flags. Linked with ``-ffast-math`` (or
``-Ofast``, ``-funsafe-math-optimizations``), GCC adds ``crtfastmath.o``, whose
constructor turns on flush-to-zero and denormals-are-zero in the MXCSR of the thread
that loads the library, and of every thread it starts later: loading the attention
kernel changed how all of that thread's torch ops round tiny numbers."""


def build(compiler: str, target: Path, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> None:
    """Compiles ``source`` with ``flags`` (less ``-shared``) and links it with ``_LINK``
    only, into ``target`` (atomically: a temporary file renamed).

    Raises:
        subprocess.CalledProcessError, OSError: the compiler failed or is missing.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / f"{target.stem}.o", Path(tmp) / target.name
        compile_flags = [flag for flag in flags if flag != "-shared"]
        for command in ([compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
                        [compiler, str(obj), "-o", str(out), *_LINK]):
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        os.replace(out, target)


def build_and_load(label: str, source: Path, flags: tuple[str, ...], switch: str, fallback: str,
                   bind: Callable[[ctypes.CDLL], object]) -> object | None:
    """``bind(library)`` for the C library built from ``source`` with ``flags`` (cached on
    disk: ``library_path``), or ``None``, logged, where it cannot be had: the environment
    variable ``switch`` set to ``0``, no compiler, a failed build, or a symbol ``bind``
    does not find. ``label`` names the kernel and ``fallback`` what runs instead, in the
    log. The kernels' ``load`` functions call it once per process, under their lock."""
    if os.environ.get(switch, "1") == "0":
        log.info("%s off (%s=0): %s", label, switch, fallback)
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler ($CC, cc, gcc): %s instead of the %s", fallback, label)
        return None
    try:
        path = library_path(compiler, source, flags)
        if not path.exists():
            log.info("building the %s into %s", label, path)
            build(compiler, path, source, flags)
        else:
            log.info("loading the %s from %s", label, path)
        return bind(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError, AttributeError) as err:
        detail = getattr(err, "stderr", "") or err
        log.warning("the %s could not be built (%s): %s", label, detail, fallback)
        return None


def load_once(loaded: dict, lock: threading.Lock, key: str, needed_flags: set[str], lacking: str, label: str,
              source: Path, flags: tuple[str, ...], switch: str, fallback: str,
              bind: Callable[[ctypes.CDLL], object]) -> object | None:
    """``build_and_load``'s result for ``source``, kept in ``loaded[key]`` (a kernel
    module's cache, read without ``lock`` once set, filled under it); ``None``, logged,
    where this CPU lacks one of ``needed_flags`` (``lacking`` names them in the log)."""
    kernel = loaded.get(key, _UNSET)
    if kernel is not _UNSET:
        return kernel
    with lock:
        if key not in loaded:
            if needed_flags <= set(cpu_flags().split()):
                loaded[key] = build_and_load(label, source, flags, switch, fallback, bind)
            else:
                log.info("this CPU lacks %s: %s instead of the %s", lacking, fallback, label)
                loaded[key] = None
        return loaded[key]


def _bind_attention(lib: ctypes.CDLL):
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.paged_attention_scores_on_amx.restype = ctypes.c_int
    _loaded["amx"] = bool(lib.paged_attention_scores_on_amx())
    if _loaded["amx"]:
        log.info("CPU attention kernel: bfloat16 scores on AMX tiles")
    return fn


def load():
    """The kernel's ``ctypes`` function, built if needed; ``None`` where it cannot be
    (no compiler, a failed build, or ``MESHSERVE_CPU_ATTENTION_KERNEL=0``). Once per process."""
    fn = _loaded.get("fn", _UNSET)  # no lock once loaded
    if fn is not _UNSET:
        return fn
    with _lock:
        if "fn" not in _loaded:
            _loaded["fn"] = build_and_load("CPU attention kernel", SOURCE, FLAGS, "MESHSERVE_CPU_ATTENTION_KERNEL",
                                           "torch decode attention", _bind_attention)
        return _loaded["fn"]


def scores_on_amx() -> bool:
    """Whether the loaded kernel multiplies a bfloat16 cache's scores on AMX tiles (a CPU
    with AMX-BF16 whose kernel lets this process use them); False where no kernel loaded."""
    return load() is not None and _loaded.get("amx", False)


def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel can run on these tensors (CPU, float32 or bfloat16, contiguous
    cache) and torch runs on one thread."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and key_cache.dtype == q.dtype
            and key_cache.is_contiguous() and torch.get_num_threads() == 1)


def check_decode_shapes(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raises RuntimeError unless ``decode_attention``'s tensors fit together (shapes, dtypes,
    layouts; not the values: block ids and lengths are the engine's to keep in range)."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"decode attention takes q (n, heads, head_dim) float32 or bfloat16, not "
                           f"{tuple(q.shape)} {q.dtype}")
    n, num_heads, head_dim = q.shape
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if (cache.dim() != 4 or cache.dtype != q.dtype or not cache.is_contiguous() or cache.shape[3] != head_dim
                or cache.shape != key_cache.shape or cache.shape[2] < 1 or num_heads % cache.shape[2]):
            raise RuntimeError(f"decode attention takes a contiguous {name} (blocks, block_size, kv_heads, "
                               f"{head_dim}) {q.dtype} (kv_heads dividing {num_heads}), not {tuple(cache.shape)} "
                               f"{cache.dtype}")
    if (block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] < n
            or block_table.stride(1) != 1):
        raise RuntimeError(f"decode attention takes a block_table of at least {n} int32 rows of contiguous entries, "
                           f"not {tuple(block_table.shape)} {block_table.dtype}")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] < n or not seq_lens.is_contiguous():
        raise RuntimeError(f"decode attention takes contiguous seq_lens of at least {n} int32, not "
                           f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    if out is not None and (out.dtype != q.dtype or not out.is_contiguous() or out.dim() != 3
                            or out.shape[0] < n or out.shape[1:] != q.shape[1:]):
        raise RuntimeError(f"decode attention writes a contiguous out of at least {n} rows of {tuple(q.shape[1:])} "
                           f"{q.dtype}, not {tuple(out.shape)} {out.dtype}")


def decode_attention(fn, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` ``(n, num_heads, head_dim)`` (one query token per request) over
    each request's ``seq_lens[i]`` cached keys; ``block_table`` ``(n, max_blocks)`` int32
    and ``seq_lens`` ``(n,)`` int32, contiguous. Returns ``(n, num_heads, head_dim)`` in
    ``q``'s dtype: ``out`` (contiguous, at least ``n`` rows, its first ``n`` written)
    when given, else a new tensor.

    Raises:
        RuntimeError: the tensors do not fit together (the C kernel trusts its sizes: it would
            read or write out of bounds), as a torch op raises on mismatched shapes.
        MemoryError: the kernel could not allocate its scratch memory.
    """
    q = q.contiguous()
    check_decode_shapes(q, key_cache, value_cache, block_table, seq_lens, out)
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(q)
    rc = fn(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
            block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), n, num_heads, num_kv_heads, head_dim,
            block_size, scale, int(q.dtype == torch.bfloat16))
    if rc:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out


@torch.library.custom_op("meshserve::padded_decode_attention", mutates_args=())
def padded_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, num_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer's decode attention for a batch padded to a fixed size, as one op that
    ``torch.compile`` keeps in its graph (``executor.worker.compiled_decode``): writes the
    first ``num_valid`` rows of ``k``, ``v`` ``(B, num_kv_heads, head_dim)`` into the
    caches at ``slot_mapping[:num_valid]`` and attends ``q[:num_valid]`` ``(B, num_heads,
    head_dim)`` over them with the kernel. ``num_valid``: a 0-dim int64 CPU tensor (a
    tensor, so that one compiled graph serves every fill of the bucket); ``block_table``
    ``(B, max_blocks)`` int32, ``seq_lens`` ``(B,)`` int32. Returns ``(B, num_heads,
    head_dim)``, the padding rows zero. Needs ``load()`` to have succeeded.

    The cache write is not declared (``mutates_args=()``; the C++ twin's schema alike): a
    layer's key and value caches are views of one allocation (``executor.worker.kv_cache``),
    and inductor re-inplaces only one mutated argument per storage, so with the write
    declared every compiled step copied each layer's value cache (with its keys) out and
    back: ~1 GB each way a step at the default 1 GiB cache, which made ``--compile``
    several times slower than eager in serving. Nothing else in the graph reads or writes
    the caches, so the write cannot be reordered against another access.

    Raises:
        MemoryError: the kernel could not allocate its scratch memory.
    """
    n = int(num_valid)
    _, _, num_kv_heads, head_dim = key_cache.shape
    slots = slot_mapping[:n]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[:n])
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[:n])
    out = q.new_empty(q.shape)
    if n < q.shape[0]:
        out[n:].zero_()
    decode_attention(load(), q[:n], key_cache, value_cache, block_table, seq_lens, scale, out)
    return out


@padded_decode_attention.register_fake
def _(q, k, v, key_cache, value_cache, slot_mapping, block_table, seq_lens, num_valid, scale):
    return q.new_empty(q.shape)
