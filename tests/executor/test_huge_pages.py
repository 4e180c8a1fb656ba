"""executor.huge_pages: large CPU buffers asked for on transparent huge pages (the
mapping carries the kernel's ``hg`` flag, MADV_HUGEPAGE), aligned to 2 MiB, with their
shape and dtype; small buffers, and every buffer with MESHSERVE_HUGE_PAGES=0, on ordinary
pages; many small buffers carved one after another from shared huge-page chunks (an
``Arena``); the KV cache and the GEMM's packed weights allocated through it."""

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
    monkeypatch.setattr(cpu_gemm, "_PACKED_WEIGHTS", huge_pages.Arena())  # this process packed others before
    packed = cpu_gemm.pack_panels(torch.randn(3072, 576), kernel)  # 7 MiB
    assert "hg" in _vm_flags(packed.data_ptr())
    # a layer's small weights too (1.3 MiB and 0.4 MiB: on 4 KiB heap pages before the arena),
    # each right after the one packed before it
    q = cpu_gemm.pack_panels(torch.randn(576, 576), kernel)
    k = cpu_gemm.pack_panels(torch.randn(192, 576), kernel)
    assert "hg" in _vm_flags(q.data_ptr()) and "hg" in _vm_flags(k.data_ptr())
    assert q.data_ptr() % 64 == 0 and k.data_ptr() == q.data_ptr() + q.numel() * 4


def test_an_arena_carves_aligned_buffers_one_after_another():
    arena = huge_pages.Arena(chunk_bytes=4096)
    a = arena.empty((10,), torch.float32)  # 40 bytes: the next starts 64 bytes on
    b = arena.empty((3, 4), torch.bfloat16)
    c = arena.empty((100,), torch.int64)  # 800 bytes
    assert (a.shape, a.dtype, b.shape, b.dtype, c.shape, c.dtype) == (
        (10,), torch.float32, (3, 4), torch.bfloat16, (100,), torch.int64)
    assert a.is_contiguous() and b.is_contiguous() and c.is_contiguous()
    assert a.data_ptr() % 64 == 0
    assert (b.data_ptr() - a.data_ptr(), c.data_ptr() - a.data_ptr()) == (64, 128)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    a.fill_(1.0), b.fill_(2.0), c.fill_(-3)  # no buffer overlaps another
    assert (float(a.sum()), float(b.sum()), int(c.sum())) == (10.0, 24.0, -300)


def test_an_arena_starts_a_new_chunk_when_full_and_gives_a_large_buffer_its_own():
    arena = huge_pages.Arena(chunk_bytes=1024)
    first = arena.empty((200,), torch.uint8)  # rounded up to 256 bytes
    rest = [arena.empty((256,), torch.uint8) for _ in range(3)]  # up to a quarter of a chunk is carved
    assert [t.data_ptr() - first.data_ptr() for t in rest] == [256, 512, 768]  # the chunk is full
    fresh = arena.empty((1,), torch.uint8)
    assert fresh.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert fresh.data_ptr() == fresh.untyped_storage().data_ptr()
    large = arena.empty((257,), torch.uint8)  # over a quarter: a buffer of its own
    assert large.untyped_storage().nbytes() == 257
    assert arena.empty((8,), torch.uint8).data_ptr() == fresh.data_ptr() + 64  # the new chunk goes on


def test_an_arena_chunk_must_hold_whole_cache_lines():
    for bad in (0, -64, 100):
        with pytest.raises(ValueError, match="multiple of 64"):
            huge_pages.Arena(chunk_bytes=bad)


@linux
@thp
def test_an_arena_chunk_is_asked_for_on_huge_pages(monkeypatch):
    monkeypatch.delenv("MESHSERVE_HUGE_PAGES", raising=False)
    arena = huge_pages.Arena()
    small = arena.empty((1000,), torch.float32)
    assert small.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0  # the chunk's start
    assert "hg" in _vm_flags(small.data_ptr())


@linux
def test_an_arena_follows_the_switch_with_a_new_chunk(monkeypatch):
    """A chunk made with MESHSERVE_HUGE_PAGES=0 is not carved once the switch is back on
    (and the other way round): the next buffer starts a chunk of the other kind."""
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    monkeypatch.setenv("MESHSERVE_HUGE_PAGES", "0")
    arena = huge_pages.Arena(chunk_bytes=8 << 20)
    off = arena.empty((1000,), torch.float32)
    assert arena.empty((10,), torch.float32).data_ptr() == off.data_ptr() + 4032  # the same chunk, 64-aligned
    assert calls == []
    monkeypatch.delenv("MESHSERVE_HUGE_PAGES")
    on = arena.empty((1000,), torch.float32)
    assert on.untyped_storage().data_ptr() != off.untyped_storage().data_ptr()
    assert calls == [(on.data_ptr(), 8 << 20, 14)]  # a new chunk, asked for on huge pages
    monkeypatch.setenv("MESHSERVE_HUGE_PAGES", "0")
    assert arena.empty((10,), torch.float32).untyped_storage().data_ptr() not in (
        on.untyped_storage().data_ptr(), off.untyped_storage().data_ptr())
