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
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MIN_BYTES = 4 << 20
"""Smaller buffers stay on ordinary pages (the rounding up would waste more than it saves)."""
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
