"""The Triton paged-attention kernels and backend against the torch backend (the oracle).

Without CUDA the kernels run in Triton's interpreter: ``TRITON_INTERPRET`` is read
when ``@triton.jit`` decorates (triton's own library functions included, at
``import triton``), so it is set here before anything imports triton. With CUDA
the same tests run natively, plus the ``gpu`` ones (bf16, realistic shapes).

Imports only torch, numpy, pytest, triton and ``executor.attention`` (so
``tests/gpu_check.sh`` runs it on a bare image with ``--noconftest``).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
_TRITON_IMPORTED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from executor.attention import build_attention_metadata, get_backend  # noqa: E402
from executor.attention.registry import available_backends, resolve_backend_name  # noqa: E402
from executor.attention.metadata import AttentionMetadata  # noqa: E402

if not CUDA:
    if _TRITON_IMPORTED_EARLY:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this module on its own",
                    allow_module_level=True)
    from tests.support.triton_interpreter import patch_for_numpy_2_4

    patch_for_numpy_2_4()

from executor.attention import triton_kernels  # noqa: E402
from executor.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
F32_TOL = 1e-5 if not CUDA else 1e-4
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


# --------------------------------------------------------------------------- helpers


def make_batch(block_size: int, query_lens: list[int], contexts: list[int], spare_blocks: int = 5,
               seed: int = 0) -> tuple[AttentionMetadata, int]:
    """Metadata of a batch (decodes first) whose requests own shuffled, non-contiguous
    physical blocks; returns it and the cache's number of blocks."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in zip(contexts, query_lens)]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    blocks, i = [], 0
    for n in need:
        blocks.append(perm[i:i + n])
        i += n
    return build_attention_metadata(query_lens, contexts, blocks, block_size, DEVICE), num_blocks


def fresh(md: AttentionMetadata) -> AttentionMetadata:
    """A copy of ``md`` without a plan (each backend plans its own)."""
    return AttentionMetadata(**{**md.__dict__, "plan": None})


def run_both(block_size: int, head_dim: int, group: int, query_lens: list[int], contexts: list[int],
             num_kv_heads: int = 2, dtype: torch.dtype = torch.float32, partition_size: int | None = None,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """One step through the triton and torch backends on identical random caches
    (the random content is the cached context); q/k/v are strided views of one qkv
    tensor, as a model produces them. Returns both outputs and both caches."""
    md, num_blocks = make_batch(block_size, query_lens, contexts, seed=seed)
    num_heads = num_kv_heads * group
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(md.num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = (torch.randn(shape, generator=gen).to(DEVICE, dtype), torch.randn(shape, generator=gen).to(DEVICE, dtype))
    ref_cache = (cache[0].clone(), cache[1].clone())
    scale = head_dim**-0.5
    triton_backend = TritonAttentionBackend(partition_size)
    md_triton = fresh(md)
    triton_backend.plan(md_triton)
    out = triton_backend.forward(q, k, v, cache, md_triton, scale)
    ref = get_backend("torch").forward(q, k, v, ref_cache, fresh(md), scale)
    return out, ref, cache, ref_cache


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float = F32_TOL) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


PARAMS = pytest.mark.parametrize("block_size,head_dim,group", [
    (bs, d, g) for bs in (16, 32) for d in (64, 128) for g in (1, 3, 8)])


# --------------------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_exactly_its_slots(block_size):
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 64, 9
    gen = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen)  # strided k/v views
    k, v = kv[:, :num_kv_heads].to(DEVICE), kv[:, num_kv_heads + 1:].to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    want_k.view(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep.to(DEVICE)]
    want_v.view(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep.to(DEVICE)]

    triton_kernels.reshape_and_cache(k, v, key_cache, value_cache, slots.to(DEVICE))

    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)


# --------------------------------------------------------------------------- decode


@PARAMS
def test_decode_split_k_matches_torch(block_size, head_dim, group):
    bs = block_size
    seq_lens = [3 * bs + 1, bs + 1, bs, bs - 1, 1]  # ragged, around block boundaries
    out, ref, cache, ref_cache = run_both(bs, head_dim, group, [1] * len(seq_lens), [s - 1 for s in seq_lens],
                                          partition_size=32, seed=bs + head_dim + group)
    assert triton_kernels.decode_num_partitions(3 * bs + 1, 32) > 1
    assert_close(out, ref)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])


def test_decode_single_partition_writes_output_directly():
    out, ref, _, _ = run_both(16, 64, 3, [1, 1, 1], [40, 16, 0])  # default partition: one, no stage 2
    assert_close(out, ref)


def test_decode_long_context_many_partitions():
    seq_lens = [700, 64, 129, 1]
    out, ref, _, _ = run_both(16, 64, 8, [1] * 4, [s - 1 for s in seq_lens], num_kv_heads=1, partition_size=64)
    assert triton_kernels.decode_num_partitions(700, 64) == 11
    assert_close(out, ref)


# --------------------------------------------------------------------------- prefill / mixed


@PARAMS
def test_mixed_decodes_and_prefill_chunks_match_torch(block_size, head_dim, group):
    bs = block_size
    query_lens = [1, 1, 1, bs + 1, bs - 1, 3, 2]
    contexts = [3 * bs, bs - 1, 0, 0, 2 * bs + 1, bs, bs - 1]  # prefills after cached context, and from scratch
    out, ref, cache, ref_cache = run_both(bs, head_dim, group, query_lens, contexts, partition_size=32,
                                          seed=7 * bs + head_dim + group)
    assert_close(out, ref)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])


def test_prefill_only_batch_with_long_context():
    out, ref, _, _ = run_both(32, 64, 3, [70, 5], [0, 300], num_kv_heads=1)
    assert_close(out, ref)


def test_plan_is_reused_across_layers():
    md, num_blocks = make_batch(16, [1, 1, 20], [50, 3, 10])
    backend = TritonAttentionBackend(partition_size=16)
    backend.plan(md)
    q = torch.randn(md.num_tokens, 6, 64, device=DEVICE)
    k, v = torch.randn(2, md.num_tokens, 2, 64, device=DEVICE)
    cache = tuple(torch.zeros(num_blocks, 16, 2, 64, device=DEVICE) for _ in range(2))
    first = backend.forward(q, k, v, cache, md, 0.125)
    tiles, workspaces = dict(md.plan.prefill_tiles), dict(md.plan.workspaces)
    second = backend.forward(q, k, v, cache, md, 0.125)
    assert torch.equal(first, second)
    assert md.plan.prefill_tiles.keys() == tiles.keys() and md.plan.workspaces.keys() == workspaces.keys()
    assert all(md.plan.workspaces[key][0] is workspaces[key][0] for key in workspaces)


# --------------------------------------------------------------------------- selection


def test_backend_selection():
    assert "triton" in available_backends()
    assert isinstance(get_backend("triton"), TritonAttentionBackend)
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    assert resolve_backend_name("torch", "cuda") == "torch"
    assert resolve_backend_name("triton", "cpu") == "triton"
    with pytest.raises(ValueError):
        resolve_backend_name("nope", "cpu")
    with pytest.raises(ValueError):
        TritonAttentionBackend(partition_size=48)


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_mixed_batch(dtype, block_size, group):
    query_lens = [1] * 6 + [300, 77, 2]
    contexts = [4000, 1500, 513, 512, 31, 0, 0, 1000, 2047]
    out, ref, _, _ = run_both(block_size, 128, group, query_lens, contexts, num_kv_heads=4, dtype=dtype,
                              partition_size=256, seed=block_size + group)
    # the reference in float32 from the same (half-precision) inputs
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_realistic_decode_and_prefill_bf16():
    query_lens = [1] * 32 + [1024, 513]
    contexts = [16384 - 1, 8000] + [1000 + 97 * i for i in range(30)] + [0, 3000]
    out, ref, _, _ = run_both(16, 128, 4, query_lens, contexts, num_kv_heads=8, dtype=torch.bfloat16, seed=3)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
