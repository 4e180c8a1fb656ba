"""The reference attention backend in plain PyTorch (CPU, or any device).

Per layer:

1. ``index_copy_`` this step's K/V rows into the flat cache view
   ``(num_blocks * block_size, num_kv_heads, head_dim)`` at ``slot_mapping``.
2. Decodes (the first ``num_decodes`` requests, one query each) in a few padded
   batches, not one loop iteration per request: consecutive decode requests whose
   lengths are within a factor of two form a group; a group's blocks are gathered
   with one ``index_select`` into ``(group, max_blocks * block_size, num_kv_heads,
   head_dim)`` and one ``scaled_dot_product_attention`` runs with a key-padding
   mask. (The ModelRunner orders decodes longest first, so groups are few and
   padding stays under half of what is gathered.)
3. Prefill chunks one SDPA each: a chunk with no context attends to its own fresh
   K/V with ``is_causal``; a chunk after cached context gathers its blocks and uses
   a causal mask shifted by the context length.

Gather indices and masks depend only on the step, so ``plan`` builds them once and
all layers reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.attention.backend import AttentionBackend, KVCache, register_backend
from executor.attention.metadata import AttentionMetadata


@dataclass
class _Prefill:
    start: int                       # first token row of the chunk
    end: int                         # one past its last token row
    seq_len: int                     # context + chunk (tokens)
    blocks: torch.Tensor | None      # (num_blocks_needed,) int64; None when no context
    mask: torch.Tensor | None        # (query_len, seq_len) bool, True = attend; None when no context


@dataclass
class _DecodeGroup:
    start: int                       # first decode request (= token row) of the group
    end: int                         # one past its last
    blocks: torch.Tensor             # (group * max_blocks,) int64, padded with block 0
    length: int                      # max_blocks * block_size (padded key length)
    mask: torch.Tensor               # (group, 1, 1, length) bool, True = a real key


@dataclass
class _TorchPlan:
    decodes: list[_DecodeGroup]
    prefills: list[_Prefill]


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Paged attention with ``index_select`` gathers and ``scaled_dot_product_attention``."""

    def plan(self, md: AttentionMetadata) -> None:
        device = md.slot_mapping.device
        prefills = []
        for i in range(md.num_decodes, md.num_reqs):
            start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            ctx, seq_len = md.num_computed_tokens_cpu[i], md.seq_lens_cpu[i]
            blocks = mask = None
            if ctx:
                blocks = md.block_table[i, : -(-seq_len // md.block_size)].long()
                q_pos = torch.arange(ctx, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            prefills.append(_Prefill(start, end, seq_len, blocks, mask))
        md.plan = _TorchPlan(self._plan_decodes(md), prefills)

    @staticmethod
    def _plan_decodes(md: AttentionMetadata) -> list[_DecodeGroup]:
        bs, groups = md.block_size, []
        num_blocks = [-(-n // bs) for n in md.seq_lens_cpu[: md.num_decodes]]
        start = 0
        while start < md.num_decodes:
            end, low, high = start + 1, num_blocks[start], num_blocks[start]
            while end < md.num_decodes and max(high, num_blocks[end]) <= 2 * min(low, num_blocks[end]):
                low, high = min(low, num_blocks[end]), max(high, num_blocks[end])
                end += 1
            key_pos = torch.arange(high * bs, device=md.seq_lens.device)
            mask = (key_pos[None, :] < md.seq_lens[start:end, None]).view(end - start, 1, 1, high * bs)
            groups.append(_DecodeGroup(start, end, md.block_table[start:end, :high].reshape(-1).long(),
                                       high * bs, mask))
            start = end
        return groups

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        if md.plan is None:
            self.plan(md)
        plan: _TorchPlan = md.plan
        key_cache, value_cache = kv_cache
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        for g in plan.decodes:
            n = g.end - g.start
            keys = _gather(key_cache, g.blocks, n, g.length)
            values = _gather(value_cache, g.blocks, n, g.length)
            o = F.scaled_dot_product_attention(q[g.start:g.end].unsqueeze(2), keys, values, attn_mask=g.mask,
                                               scale=scale, enable_gqa=True)
            out[g.start:g.end] = o.squeeze(2)
        for p in plan.prefills:
            qi = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
            if p.blocks is None:
                ki = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
                vi = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                n = p.blocks.numel() * block_size
                ki = _gather(key_cache, p.blocks, 1, n)[:, :, : p.seq_len]
                vi = _gather(value_cache, p.blocks, 1, n)[:, :, : p.seq_len]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
        return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Rows of ``blocks`` from ``cache`` as ``(batch, num_kv_heads, length, head_dim)`` (a view)."""
    num_blocks, _, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, blocks)
    return rows.view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
