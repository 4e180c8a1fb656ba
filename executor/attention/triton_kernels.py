"""Triton kernels for the paged KV cache: cache writes, split-K decode, varlen prefill.

(Over 400 lines: the three kernels share the cache layout and the launch helpers below;
each kernel is one function.)

Cache layout (``executor/worker/kv_cache.py``): a layer's ``key_cache`` and
``value_cache`` are each ``(num_blocks, block_size, num_kv_heads, head_dim)``;
token ``t`` of a request lives in physical block ``block_table[req, t //
block_size]`` at offset ``t % block_size``. Every kernel gathers K/V rows through
the block table token by token (``BLOCK_N`` tokens per tile may span several
pages), so ``block_size`` need not be a power of two nor divide any tile size.

Kernels (each with a host wrapper below):

* ``reshape_and_cache``: scatter new K/V rows to their slots (vLLM's
  ``reshape_and_cache_flash``; slot ``-1`` = padding, skipped).
* ``paged_decode_attention``: one query per request, flash-decoding split-K
  (Tri Dao, Daniel Haziza, Francisco Massa, Grigory Sizov, "Flash-Decoding for
  long-context inference", 2023; vLLM ``paged_attention_v2``; SGLang
  ``decode_attention`` stage1/stage2). Stage 1: program ``(request, kv head,
  partition)`` runs an online softmax over its partition of ``partition_size``
  tokens for all query heads of that kv head at once (GQA: K/V loaded once per
  group, the group padded to >= 16 rows so ``tl.dot`` applies) and writes the
  partial output and its log-sum-exp. Stage 2: program ``(request, head)`` merges
  the partitions by their log-sum-exps. When one partition covers every request,
  stage 1 writes the output directly and stage 2 is skipped (vLLM's v1 path).
* ``paged_prefill_attention``: varlen causal attention of prefill chunks after a
  cached prefix, all K/V read from the cache (SGLang ``extend_attention``; vLLM
  ``unified_attention``'s packing of the query heads of one kv head into the M
  dimension of a tile: row ``m`` of a tile is token ``m // G``, head ``m % G``).
  A host-built work list maps each program to ``(request, first query token)``,
  so ragged chunks launch no empty programs.

All softmax arithmetic is float32 and in base 2 (``exp2`` with ``scale *
log2(e)``); outputs take the dtype of the output tensor (the dtype of ``q``).

Without CUDA the kernels only run in Triton's interpreter, which must be enabled
(``TRITON_INTERPRET=1``) before ``triton`` is first imported.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = math.log2(math.e)
DEFAULT_PARTITION_SIZE = 512
"""Tokens per decode partition (split-K unit), as vLLM's ``paged_attention_v2``."""

_TILE = 64       # decode: tokens per K/V tile; prefill: (token, head) rows per query tile and tokens per K/V tile
_TILE_FP32 = 32  # float32 (a test dtype) multiplies without tensor cores; smaller tiles compile far faster


# --------------------------------------------------------------------------- cache write


@triton.jit
def _reshape_and_cache_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_KVH)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(key_cache + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k, mask=mask)
    tl.store(value_cache + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch
             + offs_d[None, :], v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Writes ``key``/``value`` rows into the paged caches at ``slot_mapping``, in place.

    Args:
        key, value: ``(num_tokens, num_kv_heads, head_dim)``, the caches' dtype.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        slot_mapping: ``(num_tokens,)`` int64, ``block_id * block_size + offset``;
            ``-1`` skips the token.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _check_device(key)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
    )


# --------------------------------------------------------------------------- decode


@triton.jit
def _decode_stage1_kernel(
    q, key_cache, value_cache, block_table, seq_lens, out, mid_o, mid_lse, scale_log2,
    stride_qt, stride_qh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_ot, stride_oh, stride_mor, stride_moh, stride_mop, stride_mlr, stride_mlh,
    G: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens + req)
    start = part * PARTITION_SIZE
    if start >= seq_len:  # this request has fewer partitions
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    offs_g = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)  # head within the group
    heads = kv_head * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_g < G
    mask_d = offs_d < HEAD_DIM
    qv = tl.load(q + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(block_table + req * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_page = offs_n % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache + page[:, None] * stride_kcb + in_page[:, None] * stride_kcs + kv_head * stride_kch
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(qv, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # every tile holds >= 1 real key, so m_new is finite on every row
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(value_cache + page[:, None] * stride_vcb + in_page[:, None] * stride_vcs + kv_head * stride_vch
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    o_mask = mask_h[:, None] & mask_d[None, :]
    if DIRECT_OUT:
        tl.store(out + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l[:, None]).to(out.dtype.element_ty), mask=o_mask)
    else:
        tl.store(mid_o + req * stride_mor + heads[:, None] * stride_moh + part * stride_mop + offs_d[None, :],
                 acc / l[:, None], mask=o_mask)
        tl.store(mid_lse + req * stride_mlr + heads * stride_mlh + part, m + tl.log2(l), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    mid_o, mid_lse, seq_lens, out,
    stride_mor, stride_moh, stride_mop, stride_mlr, stride_mlh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION_SIZE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    num_parts = tl.cdiv(tl.load(seq_lens + req), PARTITION_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    o_base = mid_o + req * stride_mor + head * stride_moh + offs_d
    lse_base = mid_lse + req * stride_mlr + head * stride_mlh
    m = tl.load(lse_base)  # partition 0 always exists
    l = tl.exp2(m - m)
    acc = tl.load(o_base, mask=mask_d, other=0.0)
    for part in range(1, num_parts):
        lse = tl.load(lse_base + part)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * tl.load(o_base + part * stride_mop, mask=mask_d, other=0.0)
        l = l * alpha + w
        m = m_new
    tl.store(out + req * stride_ot + head * stride_oh + offs_d, (acc / l).to(out.dtype.element_ty), mask=mask_d)


def decode_num_partitions(max_seq_len: int, partition_size: int = DEFAULT_PARTITION_SIZE) -> int:
    """Partitions the longest decode context splits into (the stage-1 grid's third axis)."""
    return max(1, -(-max_seq_len // partition_size))


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                           partition_size: int = DEFAULT_PARTITION_SIZE,
                           workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Single-query paged attention with flash-decoding split-K; writes and returns ``out``.

    Args:
        out: ``(num_seqs, num_heads, head_dim)``, any dtype (usually ``q``'s).
        q: ``(num_seqs, num_heads, head_dim)``, the caches' dtype; row ``i`` is request
            ``i``'s only query, at position ``seq_lens[i] - 1``.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        block_table: ``(>= num_seqs, max_blocks)`` int32, rows ``0 .. num_seqs``.
        seq_lens: ``(>= num_seqs,)`` int32, keys per request (>= 1), entries ``0 .. num_seqs``.
        scale: softmax scale.
        max_seq_len: ``max(seq_lens[:num_seqs])`` (host int: sizes the grid without a sync).
        partition_size: tokens per split-K partition; a power of two >= 16.
        workspace: optional ``(mid_o (num_seqs, num_heads, P, head_dim) float32,
            mid_lse (num_seqs, num_heads, P) float32)`` with ``P >=
            decode_num_partitions(max_seq_len, partition_size)``; allocated if None.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return out
    q = _last_dim_contiguous(q)
    _check_device(q)
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_h = max(16, min(64, triton.next_power_of_2(group)))
    head_blocks = -(-group // block_h)
    block_n = min(_tile(q.dtype), partition_size)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    num_parts = decode_num_partitions(max_seq_len, partition_size)
    direct = num_parts == 1
    if direct:
        mid_o = mid_lse = out  # unused
    elif workspace is not None:
        mid_o, mid_lse = workspace
    else:
        mid_o = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_stage1_kernel[(num_seqs, num_kv_heads * head_blocks, num_parts)](
        q, key_cache, value_cache, block_table, seq_lens, out, mid_o, mid_lse, scale * _LOG2E,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_table.stride(0), out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        G=group, HEAD_BLOCKS=head_blocks, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_N=block_n, PARTITION_SIZE=partition_size, DIRECT_OUT=direct,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    if not direct:
        _decode_stage2_kernel[(num_seqs, num_heads)](
            mid_o, mid_lse, seq_lens, out,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION_SIZE=partition_size,
        )
    return out


# --------------------------------------------------------------------------- prefill / extend


@triton.jit
def _prefill_kernel(
    q, key_cache, value_cache, block_table, seq_lens, query_start_loc, tile_req, tile_q0, out, scale_log2,
    stride_qt, stride_qh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req + tile)
    q0 = tl.load(tile_q0 + tile)              # first query token of the tile, within the request
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    seq_len = tl.load(seq_lens + req)
    context = seq_len - q_len                 # tokens cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    tok = q0 + offs_m // G
    heads = kv_head * G + offs_m % G
    mask_m = (offs_m < BLOCK_Q * G) & (tok < q_len)
    q_pos = context + tok
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    qv = tl.load(q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, context + q0 + BLOCK_Q)  # causal: keys up to the tile's last query
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        page = tl.load(block_table + req * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_page = offs_n % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache + page[:, None] * stride_kcb + in_page[:, None] * stride_kcs + kv_head * stride_kch
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(qv, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
        # the first tile holds key 0 (<= every q_pos), so m and m_new are finite from then on
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(value_cache + page[:, None] * stride_vcb + in_page[:, None] * stride_vcs + kv_head * stride_vch
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    tl.store(out + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             (acc / l[:, None]).to(out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_block_q(num_queries_per_kv: int, dtype: torch.dtype) -> int:
    """Query tokens per prefill tile of ``q`` of ``dtype``: ``BLOCK_M // G`` (rows are
    (token, head) pairs)."""
    return max(1, _prefill_block_m(num_queries_per_kv, dtype) // num_queries_per_kv)


def _prefill_block_m(group: int, dtype: torch.dtype) -> int:
    return max(_tile(dtype), triton.next_power_of_2(group))


def prefill_work_list(query_start_loc: list[int], first_req: int, block_q: int) -> tuple[list[int], list[int]]:
    """The prefill kernel's programs: ``(tile_req, tile_q0)``, one entry per ``block_q``
    query tokens of each request ``first_req .. len(query_start_loc) - 2``.

    Args:
        query_start_loc: the batch's cumulative query lengths (host list).
        first_req: the first prefill request (= ``num_decodes``).
        block_q: ``prefill_block_q(num_heads // num_kv_heads, q.dtype)``.
    """
    reqs, q0s = [], []
    for req in range(first_req, len(query_start_loc) - 1):
        starts = range(0, query_start_loc[req + 1] - query_start_loc[req], block_q)
        reqs.extend([req] * len(starts))
        q0s.extend(starts)
    return reqs, q0s


def paged_prefill_attention(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            tile_req: torch.Tensor, tile_q0: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal varlen attention of chunks after cached context; writes and returns ``out``.

    Request ``r`` (each ``r`` in ``tile_req``) has query rows ``query_start_loc[r] :
    query_start_loc[r + 1]`` of ``q``, at positions ``seq_lens[r] - query_len ..
    seq_lens[r] - 1``; query at position ``p`` attends to keys ``0 .. p``, all read
    from the cache (the chunk's own K/V must already be written there).

    Args:
        out: ``(num_tokens, num_heads, head_dim)``; only the listed requests' rows are written.
        q: ``(num_tokens, num_heads, head_dim)``, the caches' dtype.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        block_table: ``(num_reqs, max_blocks)`` int32.
        seq_lens: ``(num_reqs,)`` int32.
        query_start_loc: ``(num_reqs + 1,)`` int32.
        tile_req, tile_q0: ``(num_tiles,)`` int32, from ``prefill_work_list`` with
            ``block_q = prefill_block_q(num_heads // num_kv_heads, q.dtype)``.
        scale: softmax scale.
    """
    num_tiles = tile_req.numel()
    if num_tiles == 0:
        return out
    q = _last_dim_contiguous(q)
    _check_device(q)
    _, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, key_cache, value_cache, block_table, seq_lens, query_start_loc, tile_req, tile_q0, out, scale * _LOG2E,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_table.stride(0), out.stride(0), out.stride(1),
        G=group, BLOCK_M=_prefill_block_m(group, q.dtype), BLOCK_Q=prefill_block_q(group, q.dtype),
        BLOCK_N=_tile(q.dtype),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    return out


# --------------------------------------------------------------------------- helpers


def _tile(dtype: torch.dtype) -> int:
    return _TILE_FP32 if dtype == torch.float32 else _TILE


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply exactly ("ieee"), not in TF32; others ignore the option."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise RuntimeError("Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 set before triton is imported "
                           f"(got a {x.device.type} tensor)")

