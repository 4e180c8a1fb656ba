"""executor.huge_pages: large CPU buffers asked for on transparent huge pages (the
mapping carries the kernel's ``hg`` flag, MADV_HUGEPAGE), aligned to 2 MiB, with their
shape and dtype; small buffers, and every buffer with MESHSERVE_HUGE_PAGES=0, on ordinary
pages; the KV cache and the GEMM's packed weights allocated through it."""

from __future__ import annotations

import sys

import pytest
import torch

from executor import huge_pages
from executor.worker.kv_cache import allocate_kv_storage

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside, flags = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                flags = set(line.split()[1:])
                break
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


@linux
def test_a_large_buffer_is_asked_for_on_huge_pages(monkeypatch):
    monkeypatch.delenv("MESHSERVE_HUGE_PAGES", raising=False)
    t = huge_pages.empty((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(t.data_ptr())
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * 3 * (1 << 20)


@linux
def test_small_buffers_and_the_switch_keep_ordinary_pages(monkeypatch):
    small = huge_pages.empty((1000,), torch.bfloat16)
    assert small.shape == (1000,) and small.dtype == torch.bfloat16
    monkeypatch.setenv("MESHSERVE_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    off = huge_pages.empty((2, 1 << 21), torch.float32)  # 16 MiB
    assert off.shape == (2, 1 << 21)
    assert "hg" not in _vm_flags(off.data_ptr())


@linux
def test_the_kv_cache_is_zeroed_on_huge_pages(monkeypatch):
    monkeypatch.delenv("MESHSERVE_HUGE_PAGES", raising=False)
    storage = allocate_kv_storage(4, 256, 16, 3, 64, torch.float32)  # 12 MiB
    assert storage.shape == (4, 2, 256, 16, 3, 64) and storage.is_contiguous()
    assert int(storage.count_nonzero()) == 0
    assert "hg" in _vm_flags(storage.data_ptr())


@linux
def test_packed_weights_are_on_huge_pages(monkeypatch, one_thread):
    from executor.models import cpu_gemm

    monkeypatch.delenv("MESHSERVE_HUGE_PAGES", raising=False)
    kernel = cpu_gemm.load()
    if kernel is None:
        pytest.skip("no C compiler, or no AVX2/FMA on this host")
    packed = cpu_gemm.pack_panels(torch.randn(3072, 576), kernel)  # 7 MiB
    assert "hg" in _vm_flags(packed.data_ptr())
