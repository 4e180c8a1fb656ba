"""executor.huge_pages: large CPU buffers asked for on transparent huge pages (the
mapping carries the kernel's ``hg`` flag, MADV_HUGEPAGE), aligned to 2 MiB, with their
shape and dtype; small buffers, and every buffer with MESHSERVE_HUGE_PAGES=0, on ordinary
pages; the KV cache and the GEMM's packed weights allocated through it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from executor import huge_pages
from executor.worker.kv_cache import allocate_kv_storage

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
thp = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                         reason="a kernel built without transparent huge pages refuses MADV_HUGEPAGE")


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
@thp
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
    """No madvise and no 2 MiB of slack for a small buffer, nor for any with the switch off
    (the mapping's own flags are not checked here: the C allocator may hand out memory a
    freed huge-page buffer of this process left behind)."""
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    small = huge_pages.empty((1000,), torch.bfloat16)
    assert small.shape == (1000,) and small.dtype == torch.bfloat16
    assert small.untyped_storage().nbytes() == 2000 and calls == []
    monkeypatch.setenv("MESHSERVE_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    off = huge_pages.empty((2, 1 << 21), torch.float32)  # 16 MiB
    assert off.shape == (2, 1 << 21)
    assert off.untyped_storage().nbytes() == 16 << 20 and calls == []
    monkeypatch.delenv("MESHSERVE_HUGE_PAGES")
    on = huge_pages.empty((2, 1 << 21), torch.float32)
    assert on.untyped_storage().nbytes() == (16 << 20) + huge_pages.HUGE_PAGE_BYTES
    assert calls == [(on.data_ptr(), 16 << 20, 14)]  # MADV_HUGEPAGE over the aligned buffer


@linux
@thp
def test_the_kv_cache_is_zeroed_on_huge_pages(monkeypatch):
    monkeypatch.delenv("MESHSERVE_HUGE_PAGES", raising=False)
    storage = allocate_kv_storage(4, 256, 16, 3, 64, torch.float32)  # 12 MiB
    assert storage.shape == (4, 2, 256, 16, 3, 64) and storage.is_contiguous()
    assert int(storage.count_nonzero()) == 0
    assert "hg" in _vm_flags(storage.data_ptr())


@linux
@thp
def test_packed_weights_are_on_huge_pages(monkeypatch, one_thread):
    from executor.models import cpu_gemm

    monkeypatch.delenv("MESHSERVE_HUGE_PAGES", raising=False)
    kernel = cpu_gemm.load()
    if kernel is None:
        pytest.skip("no C compiler, or no AVX2/FMA on this host")
    packed = cpu_gemm.pack_panels(torch.randn(3072, 576), kernel)  # 7 MiB
    assert "hg" in _vm_flags(packed.data_ptr())
