"""The reference attention backend in plain PyTorch (CPU, or any device).

Per layer:

1. ``index_copy_`` this step's K/V rows into the flat cache view
   ``(num_blocks * block_size, num_kv_heads, head_dim)`` at ``slot_mapping``.
2. Decodes on a CPU running torch on one thread, in float32 or bfloat16: one call of
   the CPU paged decode kernel (``cpu_kernel.py``, ``cpu_paged_attention.c``) for
   all of them, reading keys and values straight from the cache (3x faster than
   the padded SDPA path below at 32 requests on one AVX2 core, and batch-invariant);
   where it cannot be built, or elsewhere, the padded SDPA path:
   decodes (the first ``num_decodes`` requests, one query each) in a few padded
   batches, not one loop iteration per request: a group of consecutive decode
   requests has its blocks gathered with one ``index_select`` into ``(group,
   max_blocks * block_size, num_kv_heads, head_dim)`` and runs one
   ``scaled_dot_product_attention`` with an additive key-padding mask.
3. Prefill chunks one SDPA each: a chunk with no context attends to its own fresh
   K/V with ``is_causal``; a chunk after cached context gathers its blocks and uses
   a causal mask shifted by the context length. Where the CPU kernel runs and every
   prefill chunk of the step is short (``seq_len <= PREFILL_KERNEL_MAX_LEN``), the
   whole step is instead one kernel call: each prefill token is a query over its own
   prefix in the cache (its request's block table row, ``position + 1`` keys), which
   is causal attention with no mask and no per-request call. On one AVX2 core, per
   layer of SmolLM2-135M: 32 prompts of 150 tokens 30.5 ms against SDPA's 42.8 (1.4x),
   9 of 227 27.4 against 33.9 (1.24x), 2 of 384 17.8 against 19.3; one of 768 31.5
   against 24.4 (SDPA's tiles reuse each key over many queries, so it wins on long
   prompts). Each token's result depends on its own prefix only: batch-invariant.
   A step that also has longer chunks runs only those in SDPA; its short chunks' tokens
   stay such rows beside the decodes, so a prompt gets the same bits beside a long one
   as alone (and as its tokens get as decodes: cached, chunked or preempted alike).
   In bfloat16 on a CPU with AVX512-BF16 but no AMX-BF16 (head_dim 64 or 128; with AMX
   SDPA is the faster, ``cpu_prefill_kernel.preferred``), a step's longer chunks
   run in the prefill kernel (``cpu_prefill_kernel.py``) instead of SDPA, one call for
   them beside the decode kernel's one call for the decodes and the shorter chunks'
   token rows: tiles of query rows share each key and value they read (30 layers of one
   SmolLM2-135M prompt on one Zen 4 core: 416 tokens 45 ms against SDPA's 172 and
   the token rows' 80, 790 tokens 155 against 471 and 281; at 150 tokens 8.7 against
   the token rows' 12.8, but short chunks keep the token rows, in any step: there a
   prompt token's row is bitwise its decode, so a prompt gives the same bits cached or
   not, chunked or not, preempted and recomputed or not, beside a long one or not,
   which the prefill kernel, rounding its probabilities to bfloat16, does not give
   against the decode kernel). The dtype is known only at ``forward``: a plan made for
   the prefill kernel falls back there (and later plans skip it) when the tensors are
   not its kind.

The gathers write into two workspaces the backend keeps (one for keys, one for
values, grown to the largest gather seen, reused by every group, layer and step):
a fresh multi-megabyte tensor per gather costs its page faults every time, which
made a decode step's attention at 32 requests about 1.7x as slow on one AVX2 core
(all layers run one after the other, and SDPA's output is a new tensor, so
nothing returned ever points into a workspace).

Planning (which path each token takes, gather indices, masks) is ``torch_plan``'s. When
one SDPA call covers the whole batch (only decodes in one group, or a single prefill
chunk), its output is returned as is, with no copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.attention import cpu_kernel, cpu_prefill_kernel
from executor.attention.backend import AttentionBackend, KVCache
from executor.attention.metadata import AttentionMetadata
from executor.attention.torch_plan import (PREFILL_KERNEL_MAX_LEN, DecodeGroup, PaddedDecodePlan, PrefillChunk,
                                           SplitRows, TorchPlan, plan_decodes, plan_prefill_fallback, plan_prefills,
                                           prefill_rows)

_UNSET = object()


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with ``index_select`` gathers and ``scaled_dot_product_attention``."""

    name = "torch"

    def __init__(self) -> None:
        self._kernel = _UNSET
        self._prefill_kernel = _UNSET
        self._prefill_kernel_takes: bool | None = None  # False once a forward's tensors did not suit it
        self._workspaces: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _workspace(self, cache: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers (keys, values) of at least ``rows`` blocks of ``cache``'s shape and dtype."""
        key = (cache.device, cache.dtype)
        need = rows * cache[0].numel()
        ws = self._workspaces.get(key)
        if ws is None or ws[0].numel() < need:
            ws = (torch.empty(need, dtype=cache.dtype, device=cache.device),
                  torch.empty(need, dtype=cache.dtype, device=cache.device))
            self._workspaces[key] = ws
        return ws

    def plan(self, md: AttentionMetadata) -> None:
        kernel = self._cpu_kernel(md)
        rows = None
        if (kernel and md.num_decodes < md.num_reqs and max(md.seq_lens_cpu[md.num_decodes:]) > PREFILL_KERNEL_MAX_LEN
                and self._prefill_kernel_takes is not False and self._cpu_prefill_kernel() is not None):
            rows = prefill_rows(md)  # the dtype is known at forward, which may still fall back
        tokens, prefills, split = (None, [], None) if rows else plan_prefill_fallback(md, kernel is not None)
        decodes = None if kernel and md.num_decodes else plan_decodes(md)  # None: the kernel decodes
        md.plan = TorchPlan(decodes, prefills, md.num_decodes, tokens, rows, split)

    def _cpu_kernel(self, md: AttentionMetadata):
        """The CPU kernel (``cpu_kernel``) when this step can use it, else None."""
        if md.num_tokens == 0 or md.slot_mapping.device.type != "cpu" or torch.get_num_threads() != 1:
            return None
        if self._kernel is _UNSET:
            self._kernel = cpu_kernel.load()
        return self._kernel

    def _cpu_prefill_kernel(self):
        """The CPU prefill kernel (``cpu_prefill_kernel``), or None where it cannot be had
        or SDPA is faster (``cpu_prefill_kernel.preferred``: a CPU with AMX-BF16)."""
        if self._prefill_kernel is _UNSET:
            self._prefill_kernel = cpu_prefill_kernel.preferred()
        return self._prefill_kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        if isinstance(md.plan, PaddedDecodePlan):  # one op, traceable by torch.compile
            return cpu_kernel.TRACED_OPS.padded_decode_attention(q, k, v, *kv_cache, md.slot_mapping,
                                                                 md.block_table, md.seq_lens, md.plan.num_valid,
                                                                 scale)
        if md.plan is None:
            self.plan(md)
        plan: TorchPlan = md.plan
        key_cache, value_cache = kv_cache
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v)
        if plan.prefill_rows is not None and not cpu_prefill_kernel.supports(q, key_cache):  # e.g. float32
            self._prefill_kernel_takes, plan.prefill_rows = False, None  # later plans skip it
            plan.tokens, plan.prefills, plan.split = plan_prefill_fallback(md, self._kernel is not None)
        if plan.prefill_rows is not None and plan.prefill_rows.rows is not None:  # long and short chunks
            rows, q = plan.prefill_rows, q.contiguous()
            out = self._split_rows(q, key_cache, value_cache, rows.split, scale)
            out.index_copy_(0, rows.rows, cpu_prefill_kernel.prefill_attention(
                self._prefill_kernel, q.index_select(0, rows.rows), key_cache, value_cache, rows.block_table,
                rows.query_start, rows.seq_lens, scale))
            return out
        if plan.prefill_rows is not None:  # decodes in the decode kernel, prefills in the prefill kernel
            n, q = plan.num_decodes, q.contiguous()
            out = torch.empty_like(q)
            if n:
                cpu_kernel.decode_attention(self._kernel, q[:n], key_cache, value_cache, md.block_table[:n],
                                            md.seq_lens[:n], scale, out)
            rows = plan.prefill_rows
            cpu_prefill_kernel.prefill_attention(self._prefill_kernel, q[n:], key_cache, value_cache,
                                                 rows.block_table, rows.query_start, rows.seq_lens, scale, out[n:])
            return out
        if (plan.decodes is None or plan.tokens is not None or plan.split is not None) and not cpu_kernel.supports(
                q, key_cache):
            if plan.tokens is not None or plan.split is not None:  # e.g. float16: SDPA prefills
                plan.tokens, plan.split, plan.prefills = None, None, plan_prefills(md)
            if plan.decodes is None:  # and padded decode groups
                plan.decodes = plan_decodes(md)
        if plan.tokens is not None:  # every token a query row over its own prefix: one call
            return cpu_kernel.decode_attention(self._kernel, q, key_cache, value_cache, plan.tokens.block_table,
                                               plan.tokens.seq_lens, scale)
        if plan.split is not None:  # decodes and short chunks: bitwise their decodes; long chunks in SDPA
            out = self._split_rows(q, key_cache, value_cache, plan.split, scale)
            for p in plan.prefills:
                out[p.start:p.end] = self._prefill(q, k, v, key_cache, value_cache, p, scale)
            return out
        if plan.decodes is None:
            n = plan.num_decodes
            decoded = cpu_kernel.decode_attention(self._kernel, q[:n], key_cache, value_cache, md.block_table[:n],
                                                  md.seq_lens[:n], scale)
            if not plan.prefills:
                return decoded
            out = torch.empty_like(q)
            out[:n] = decoded
            for p in plan.prefills:
                out[p.start:p.end] = self._prefill(q, k, v, key_cache, value_cache, p, scale)
            return out
        if len(plan.decodes) + len(plan.prefills) == 1:  # one SDPA call covers the batch: no output copy
            if plan.decodes:
                return self._decode(q, key_cache, value_cache, plan.decodes[0], scale)
            return self._prefill(q, k, v, key_cache, value_cache, plan.prefills[0], scale)
        out = torch.empty_like(q)
        for g in plan.decodes:
            out[g.start:g.end] = self._decode(q, key_cache, value_cache, g, scale)
        for p in plan.prefills:
            out[p.start:p.end] = self._prefill(q, k, v, key_cache, value_cache, p, scale)
        return out

    def _split_rows(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, split: SplitRows,
                    scale: float) -> torch.Tensor:
        """A new ``q``-shaped output with the decodes' and short chunks' rows written by the
        decode kernel (bitwise what each gets as a decode); the long chunks' rows are left
        for the caller."""
        out = torch.empty_like(q)
        out.index_copy_(0, split.others, cpu_kernel.decode_attention(
            self._kernel, q.index_select(0, split.others), key_cache, value_cache, split.other_tokens.block_table,
            split.other_tokens.seq_lens, scale))
        return out

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, g: DecodeGroup,
                scale: float) -> torch.Tensor:
        """Rows ``g.start:g.end`` of the output, ``(group, num_heads, head_dim)``."""
        n = g.end - g.start
        key_ws, value_ws = self._workspace(key_cache, g.blocks.numel())
        keys = _gather(key_cache, g.blocks, n, g.length, key_ws)
        values = _gather(value_cache, g.blocks, n, g.length, value_ws)
        if g.padding is not None:  # slots past a request's keys hold what earlier owners left: a NaN or an
            keys.masked_fill_(g.padding, 0)  # inf there would survive the mask (NaN + -inf, 0 * NaN) and
            values.masked_fill_(g.padding, 0)  # poison this request
        o = F.scaled_dot_product_attention(q[g.start:g.end].unsqueeze(2), keys, values, attn_mask=g.mask.get(q.dtype),
                                           scale=scale, enable_gqa=True)
        return o.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, p: PrefillChunk, scale: float) -> torch.Tensor:
        """Rows ``p.start:p.end`` of the output, ``(query_len, num_heads, head_dim)``."""
        qi = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
        if p.blocks is None:
            ki = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            vi = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            n = p.blocks.numel() * key_cache.shape[1]
            key_ws, value_ws = self._workspace(key_cache, p.blocks.numel())
            ki = _gather(key_cache, p.blocks, 1, n, key_ws)[:, :, : p.seq_len]
            vi = _gather(value_cache, p.blocks, 1, n, value_ws)[:, :, : p.seq_len]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask.get(q.dtype), scale=scale,
                                               enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, batch: int, length: int,
            workspace: torch.Tensor) -> torch.Tensor:
    """Rows of ``blocks`` from ``cache`` as ``(batch, num_kv_heads, length, head_dim)``, a view
    of ``workspace`` (flat, at least ``blocks.numel()`` blocks long), which it overwrites."""
    num_blocks, _, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_blocks, -1)
    rows = workspace[: blocks.numel() * flat.shape[1]].view(blocks.numel(), flat.shape[1])
    torch.index_select(flat, 0, blocks, out=rows)
    return rows.view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
