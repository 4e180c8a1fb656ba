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
   In bfloat16 on a CPU with AVX512-BF16 (head_dim 64 or 128), a step's longer chunks
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

Grouping the decodes trades padding against calls: the gather and the attention
cost about the same per padded key whatever the group, and each group costs a
fixed ~``_GROUP_COST_KEYS`` keys' worth of calls, so ``plan`` splits the decodes
into the consecutive groups of least total cost (a small dynamic program; the
ModelRunner orders decodes longest first, so groups are runs of similar lengths).
Padded keys are masked out exactly (weight 0): a request's group changes at most
the rounding of its output.

The gathers write into two workspaces the backend keeps (one for keys, one for
values, grown to the largest gather seen, reused by every group, layer and step):
a fresh multi-megabyte tensor per gather costs its page faults every time, which
made a decode step's attention at 32 requests about 1.7x as slow on one AVX2 core
(all layers run one after the other, and SDPA's output is a new tensor, so
nothing returned ever points into a workspace).

Gather indices and masks depend only on the step, so ``plan`` builds them once and
all layers reuse them; masks are additive (``0``/``-inf``) in the query dtype,
made at the first layer that needs them, so SDPA does not convert a boolean mask
in every layer. When one SDPA call covers the whole batch (only decodes in one
group, or a single prefill chunk), its output is returned as is, with no copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from executor.attention import cpu_kernel, cpu_prefill_kernel
from executor.attention.backend import AttentionBackend, KVCache
from executor.attention.metadata import AttentionMetadata

_UNSET = object()

PREFILL_KERNEL_MAX_LEN = 384
"""Longest prefill chunk (``seq_len``, context included, tokens) whose queries go through
the CPU kernel one token a row; a step with a longer chunk runs its prefills in SDPA
(in bfloat16 with the prefill kernel, only its longer chunks run there).
Measured crossover on one AVX2 core: the kernel 1.08x SDPA for 2 prompts of 384, 0.78x
for one of 768."""

_GROUP_COST_KEYS = 64
"""Fixed cost of one more decode group (two gathers and one SDPA call per layer),
in padded keys per request of the same cost: about 60 µs against about 0.8 µs per
key on one AVX2 core for a 3-KV-head, head_dim-64 model."""


@dataclass
class _Masks:
    """An additive mask built from a boolean one (True = attend), per query dtype."""

    allowed: torch.Tensor
    by_dtype: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def get(self, dtype: torch.dtype) -> torch.Tensor:
        mask = self.by_dtype.get(dtype)
        if mask is None:
            mask = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            mask.masked_fill_(~self.allowed, float("-inf"))
            self.by_dtype[dtype] = mask
        return mask


@dataclass
class _Prefill:
    start: int                       # first token row of the chunk
    end: int                         # one past its last token row
    seq_len: int                     # context + chunk (tokens)
    blocks: torch.Tensor | None      # (num_blocks_needed,) int64; None when no context
    mask: _Masks | None              # (query_len, seq_len), True = attend; None when no context


@dataclass
class _DecodeGroup:
    start: int                       # first decode request (= token row) of the group
    end: int                         # one past its last
    blocks: torch.Tensor             # (group * max_blocks,) int64, padded with block 0
    length: int                      # max_blocks * block_size (padded key length)
    mask: _Masks                     # (group, 1, 1, length), True = a real key
    padding: torch.Tensor | None = None  # (group, 1, length, 1), True = not a key; None when every slot is one


@dataclass
class _TokenRows:
    """Every token of the step as one query row of the CPU kernel."""

    block_table: torch.Tensor        # (num_tokens, max_blocks) int32: its request's row
    seq_lens: torch.Tensor           # (num_tokens,) int32: its position + 1 (keys it attends)


@dataclass
class _PrefillRows:
    """The step's long prefill chunks as the CPU prefill kernel takes them, and, when the
    step also has short ones, its other tokens as decode-kernel rows."""

    block_table: torch.Tensor        # (num_long, max_blocks) int32
    query_start: torch.Tensor        # (num_long + 1,) int32: rows of the long chunks' tokens, from 0
    seq_lens: torch.Tensor           # (num_long,) int32
    rows: torch.Tensor | None = None    # (tokens,) int64: the long chunks' token rows; None: all of q[num_decodes:]
    others: torch.Tensor | None = None  # (tokens,) int64: the other token rows (decodes, short chunks)
    other_tokens: _TokenRows | None = None  # their decode-kernel rows


@dataclass
class _TorchPlan:
    decodes: list[_DecodeGroup] | None  # None: the decodes run in the CPU kernel
    prefills: list[_Prefill]
    num_decodes: int = 0
    tokens: _TokenRows | None = None    # set: the whole step is one kernel call
    prefill_rows: _PrefillRows | None = None  # set: the prefills run in the prefill kernel


@dataclass
class PaddedDecodePlan:
    """The plan of a decode-only step padded to a fixed batch size (a bucket of
    ``executor.worker.compiled_decode``): every layer runs
    ``cpu_kernel.padded_decode_attention``, which needs no other planning."""

    num_valid: torch.Tensor          # 0-dim int64: the real decodes, the first rows; the rest is padding


def decode_groups(num_blocks: list[int], block_size: int, group_cost_keys: int = _GROUP_COST_KEYS) -> list[int]:
    """Splits decodes with ``num_blocks[i]`` blocks each into consecutive groups that
    minimise ``sum(group_cost_keys + len(group) * max_blocks(group) * block_size)``.

    Returns:
        The group boundaries ``[0, ..., len(num_blocks)]``.
    """
    n = len(num_blocks)
    if n == 0:
        return [0]
    blocks = np.asarray(num_blocks, dtype=np.int64)
    best = np.zeros(n + 1, dtype=np.int64)     # best[j]: least cost of the first j decodes
    cut = np.zeros(n + 1, dtype=np.int64)      # cut[j]: where the last group of that best split starts
    run_max = np.empty(0, dtype=np.int64)      # run_max[i]: max(blocks[i:j])
    for j in range(n):
        run_max = np.maximum(np.append(run_max, 0), blocks[j])
        cost = best[: j + 1] + group_cost_keys + (j + 1 - np.arange(j + 1)) * run_max * block_size
        cut[j + 1] = int(np.argmin(cost))
        best[j + 1] = cost[cut[j + 1]]
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(int(cut[bounds[-1]]))
    return bounds[::-1]


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
            rows = _prefill_rows(md)  # the dtype is known at forward, which may still fall back
        tokens, prefills = (None, []) if rows else self._plan_prefill_fallback(md, kernel)
        decodes = None if kernel and md.num_decodes else self._plan_decodes(md)  # None: the kernel decodes
        md.plan = _TorchPlan(decodes, prefills, md.num_decodes, tokens, rows)

    def _plan_prefill_fallback(self, md: AttentionMetadata, kernel) -> tuple[_TokenRows | None, list[_Prefill]]:
        """Without the prefill kernel: every token a query row of the decode kernel when
        every chunk is short, else one SDPA call per chunk."""
        if kernel and md.num_decodes < md.num_reqs and max(md.seq_lens_cpu[md.num_decodes:]) <= PREFILL_KERNEL_MAX_LEN:
            return _token_rows(md), []
        return None, self._plan_prefills(md)

    @staticmethod
    def _plan_prefills(md: AttentionMetadata) -> list[_Prefill]:
        """One SDPA call's inputs per prefill chunk (gathered blocks and a shifted causal
        mask for a chunk after cached context)."""
        device = md.slot_mapping.device
        prefills = []
        for i in range(md.num_decodes, md.num_reqs):
            start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            ctx, seq_len = md.num_computed_tokens_cpu[i], md.seq_lens_cpu[i]
            blocks = mask = None
            if ctx:
                blocks = md.block_table[i, : -(-seq_len // md.block_size)].long()
                q_pos = torch.arange(ctx, seq_len, device=device)
                mask = _Masks(torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None])
            prefills.append(_Prefill(start, end, seq_len, blocks, mask))
        return prefills

    def _cpu_kernel(self, md: AttentionMetadata):
        """The CPU kernel (``cpu_kernel``) when this step can use it, else None."""
        if md.num_tokens == 0 or md.slot_mapping.device.type != "cpu" or torch.get_num_threads() != 1:
            return None
        if self._kernel is _UNSET:
            self._kernel = cpu_kernel.load()
        return self._kernel

    def _cpu_prefill_kernel(self):
        """The CPU prefill kernel (``cpu_prefill_kernel``), or None where it cannot be had."""
        if self._prefill_kernel is _UNSET:
            self._prefill_kernel = cpu_prefill_kernel.load()
        return self._prefill_kernel

    @staticmethod
    def _plan_decodes(md: AttentionMetadata) -> list[_DecodeGroup]:
        bs = md.block_size
        num_blocks = [-(-n // bs) for n in md.seq_lens_cpu[: md.num_decodes]]
        bounds = decode_groups(num_blocks, bs)
        groups = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            high = max(num_blocks[start:end])
            key_pos = torch.arange(high * bs, device=md.seq_lens.device)
            allowed = (key_pos[None, :] < md.seq_lens[start:end, None]).view(end - start, 1, 1, high * bs)
            padded = any(n < high * bs for n in md.seq_lens_cpu[start:end])
            groups.append(_DecodeGroup(start, end, md.block_table[start:end, :high].reshape(-1).long(),
                                       high * bs, _Masks(allowed),
                                       (~allowed).view(end - start, 1, high * bs, 1) if padded else None))
        return groups

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        if isinstance(md.plan, PaddedDecodePlan):  # one op, traceable by torch.compile
            return cpu_kernel.TRACED_OPS.padded_decode_attention(q, k, v, *kv_cache, md.slot_mapping,
                                                                 md.block_table, md.seq_lens, md.plan.num_valid,
                                                                 scale)
        if md.plan is None:
            self.plan(md)
        plan: _TorchPlan = md.plan
        key_cache, value_cache = kv_cache
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v)
        if plan.prefill_rows is not None and not cpu_prefill_kernel.supports(q, key_cache):  # e.g. float32
            self._prefill_kernel_takes, plan.prefill_rows = False, None  # later plans skip it
            plan.tokens, plan.prefills = self._plan_prefill_fallback(md, self._kernel)
        if plan.prefill_rows is not None and plan.prefill_rows.rows is not None:  # long and short chunks
            rows, q = plan.prefill_rows, q.contiguous()
            out = torch.empty_like(q)  # decodes and short chunks in the decode kernel: bitwise their decodes
            out.index_copy_(0, rows.others, cpu_kernel.decode_attention(
                self._kernel, q.index_select(0, rows.others), key_cache, value_cache, rows.other_tokens.block_table,
                rows.other_tokens.seq_lens, scale))
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
        if (plan.decodes is None or plan.tokens is not None) and not cpu_kernel.supports(q, key_cache):
            if plan.tokens is not None:  # e.g. float16: SDPA prefills
                plan.tokens, plan.prefills = None, self._plan_prefills(md)
            if plan.decodes is None:  # and padded decode groups
                plan.decodes = self._plan_decodes(md)
        if plan.tokens is not None:  # every token a query row over its own prefix: one call
            return cpu_kernel.decode_attention(self._kernel, q, key_cache, value_cache, plan.tokens.block_table,
                                               plan.tokens.seq_lens, scale)
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

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, g: _DecodeGroup,
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
                 value_cache: torch.Tensor, p: _Prefill, scale: float) -> torch.Tensor:
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


def _prefill_rows(md: AttentionMetadata) -> _PrefillRows:
    """The long prefill chunks' (``seq_len > PREFILL_KERNEL_MAX_LEN``) block table rows,
    query starts (from their first token) and key counts. When the step also has short
    chunks, those and the decodes stay decode-kernel rows (``rows``, ``others``,
    ``other_tokens``): a short prompt gets the same bits whether a long one shares its
    step or not."""
    n, qsl = md.num_decodes, md.query_start_loc_cpu
    long = [i for i in range(n, md.num_reqs) if md.seq_lens_cpu[i] > PREFILL_KERNEL_MAX_LEN]
    if len(long) == md.num_reqs - n:  # every chunk long: they are the rows from num_decodes on
        starts = md.query_start_loc[n:]
        return _PrefillRows(md.block_table[n:], (starts - starts[0]).to(torch.int32), md.seq_lens[n:])
    device = md.query_start_loc.device
    is_long = torch.zeros(md.num_tokens, dtype=torch.bool)
    lens = []
    for i in long:
        is_long[qsl[i]:qsl[i + 1]] = True
        lens.append(qsl[i + 1] - qsl[i])
    reqs = torch.tensor(long, dtype=torch.int64, device=device)
    query_start = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=device)
    others = (~is_long).nonzero().squeeze(1).to(device)
    return _PrefillRows(md.block_table.index_select(0, reqs), query_start, md.seq_lens.index_select(0, reqs),
                        is_long.nonzero().squeeze(1).to(device), others, _token_rows(md, others))


def _token_rows(md: AttentionMetadata, rows: torch.Tensor | None = None) -> _TokenRows:
    """Each token's (or only ``rows``') block table row and key count (``position + 1``),
    built with tensor ops (no per-token Python)."""
    query_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    req = torch.repeat_interleave(torch.arange(md.num_reqs, device=query_lens.device), query_lens)
    token = torch.arange(md.num_tokens, dtype=torch.int32, device=query_lens.device)
    if rows is not None:
        req, token = req[rows], token[rows]
    seq_lens = token - md.query_start_loc[req] + md.num_computed_tokens[req] + 1
    return _TokenRows(md.block_table.index_select(0, req), seq_lens.to(torch.int32))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, batch: int, length: int,
            workspace: torch.Tensor) -> torch.Tensor:
    """Rows of ``blocks`` from ``cache`` as ``(batch, num_kv_heads, length, head_dim)``, a view
    of ``workspace`` (flat, at least ``blocks.numel()`` blocks long), which it overwrites."""
    num_blocks, _, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_blocks, -1)
    rows = workspace[: blocks.numel() * flat.shape[1]].view(blocks.numel(), flat.shape[1])
    torch.index_select(flat, 0, blocks, out=rows)
    return rows.view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
