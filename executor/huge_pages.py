"""Large CPU buffers backed by 2 MiB transparent huge pages where Linux offers them.

Why: the engine's two large CPU buffers are read from memory every decode step in
pieces scattered over hundreds of megabytes: the packed weights (``cpu_gemm.py``; 540 MB
in float32 for SmolLM2-135M) and the paged KV cache (a request's blocks lie anywhere in
it). On 4 KiB pages each 12 KiB KV block or weight panel costs fresh TLB entries, and a
TLB miss stalls the hardware and software prefetches that hide the memory latency. On
2 MiB pages (one TLB entry for 512 of the small ones) the same reads ran faster on one
AVX2 core: the 113 MB LM head at 32 rows 19.9 → 19.1 ms, the decode attention of 32
requests of ~150 tokens 37.8 → 36.0 ms a step (``python -m meshserve.bench.step_profile``).

How: the buffer is allocated 2 MiB larger than asked, aligned to 2 MiB inside, and
``madvise(MADV_HUGEPAGE)`` is called on it before anything touches it, so the kernel
faults it in as huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``always`` or ``madvise``, the usual defaults). Where that cannot be (not Linux, a
buffer under 4 MiB, ``madvise`` refused, ``MESHSERVE_HUGE_PAGES=0``) the buffer is a
plain ``torch.empty``: the numbers are the same either way, only the speed differs.

Many small buffers (a model's packed weights: SmolLM2-135M's per-layer weights are 0.66-3.5
MB each in bfloat16, under ``MIN_BYTES``) come from an ``Arena`` instead: carved one after
another out of shared 64 MiB huge-page chunks, so that they too sit on huge pages, with
no 2 MiB of slack each, in the order the model reads them. Before, those weights lay on
4 KiB pages in the C allocator's heap; with the arena the bfloat16 engine's TPOT p50 at one
request went from 18.0 to 13.6 ms on one Zen 4 core (a step streams ~270 MB of weights),
its tokens/s 1.29x at one request and 1.12x at 32 (``docs/benchmarks.md``, "Huge pages for
the packed weights"; ``reports/cpu-speed/arena/``).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import threading

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MIN_BYTES = 4 << 20
"""Smaller buffers stay on ordinary pages (the rounding up would waste more than it saves)."""
CHUNK_BYTES = 64 << 20
"""An ``Arena``'s chunk: its untouched tail costs address space only (pages are faulted in
when first written)."""
ALIGN_BYTES = 64
"""Every ``Arena`` buffer starts on a cache line (the kernels' aligned vector loads)."""
_MADV_HUGEPAGE = 14
_libc: list = []


def _madvise():
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            _libc.append(libc.madvise)
        except (OSError, AttributeError):
            _libc.append(None)
    return _libc[0]


def enabled() -> bool:
    """Whether buffers are asked for on huge pages here (Linux, ``MESHSERVE_HUGE_PAGES``
    not ``0``)."""
    return sys.platform.startswith("linux") and os.environ.get("MESHSERVE_HUGE_PAGES", "1") != "0"


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, on huge pages
    where they can be had (see the module doc), 64-byte aligned at least."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise() if enabled() and nbytes >= MIN_BYTES else None
    if madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    span = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise(raw.data_ptr() + offset, span, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): ordinary pages", ctypes.get_errno())
    return raw[offset:offset + nbytes].view(dtype).view(shape)


class Arena:
    """A bump allocator of long-lived CPU buffers over shared chunks from ``empty`` (so
    on huge pages where Linux gives them): buffers allocated one after another lie one
    after another in memory, each ``ALIGN_BYTES``-aligned. A buffer over a quarter of
    ``chunk_bytes`` gets a chunk of its own (``empty``). ``MESHSERVE_HUGE_PAGES`` is read
    on every call: switching it starts a new chunk of the other kind. Thread-safe.

    Buffers are views of their chunk: a chunk is freed once every buffer carved from it is
    freed and the arena has moved on to a newer chunk. So after a model's buffers are
    freed the arena's current chunk stays (at most ``chunk_bytes``, only its touched pages
    resident), and two models packed at the same time from two threads share chunks: one
    of them freed alone leaves the chunks they share in memory. An executor loads one model.

    Args:
        chunk_bytes: the size of a shared chunk (bytes, a multiple of ``ALIGN_BYTES``).

    Raises:
        ValueError: ``chunk_bytes`` is not a positive multiple of ``ALIGN_BYTES``.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        if chunk_bytes <= 0 or chunk_bytes % ALIGN_BYTES:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN_BYTES}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8, (chunk_bytes,)
        self._chunk_huge = False  # whether the current chunk was asked for on huge pages (``enabled()``)
        self._used = 0  # bytes of the current chunk handed out (rounded up to ALIGN_BYTES)
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, ``ALIGN_BYTES``-aligned,
        carved from the current chunk (a new one when it is full)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.chunk_bytes // 4:
            return empty(shape, dtype)
        huge = enabled()
        with self._lock:
            if self._chunk is None or self._used + nbytes > self.chunk_bytes or huge != self._chunk_huge:
                self._chunk, self._chunk_huge, self._used = empty((self.chunk_bytes,), torch.uint8), huge, 0
            start = self._used
            self._used = -(-(start + nbytes) // ALIGN_BYTES) * ALIGN_BYTES
            chunk = self._chunk
        return chunk[start:start + nbytes].view(dtype).view(shape)
