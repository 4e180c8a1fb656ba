"""How the torch attention backend (``torch_backend``) runs one step: which path each
token takes (the decode kernel's rows, the prefill kernel, padded SDPA decode groups,
one SDPA call per prefill chunk), with the gather indices, block tables and masks every
layer of the step reuses. Pure functions of the step's ``AttentionMetadata``; the
backend makes the plan once per step (``TorchAttentionBackend.plan``).

Grouping the decodes trades padding against calls: the gather and the attention
cost about the same per padded key whatever the group, and each group costs a
fixed ~``_GROUP_COST_KEYS`` keys' worth of calls, so ``plan_decodes`` splits the decodes
into the consecutive groups of least total cost (a small dynamic program; the
ModelRunner orders decodes longest first, so groups are runs of similar lengths).
Padded keys are masked out exactly (weight 0): a request's group changes at most
the rounding of its output.

Gather indices and masks depend only on the step, so the backend plans once per step and
all layers reuse them; masks are additive (``0``/``-inf``) in the query dtype,
made at the first layer that needs them, so SDPA does not convert a boolean mask
in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from executor.attention.metadata import AttentionMetadata

PREFILL_KERNEL_MAX_LEN = 384
"""Longest prefill chunk (``seq_len``, context included, tokens) whose queries go through
the CPU kernel one token a row; a longer chunk runs in SDPA (in bfloat16 with the prefill
kernel, there), the step's shorter ones staying token rows.
Measured crossover on one AVX2 core: the kernel 1.08x SDPA for 2 prompts of 384, 0.78x
for one of 768."""

_GROUP_COST_KEYS = 64
"""Fixed cost of one more decode group (two gathers and one SDPA call per layer),
in padded keys per request of the same cost: about 60 µs against about 0.8 µs per
key on one AVX2 core for a 3-KV-head, head_dim-64 model."""


@dataclass
class Masks:
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
class PrefillChunk:
    start: int                       # first token row of the chunk
    end: int                         # one past its last token row
    seq_len: int                     # context + chunk (tokens)
    blocks: torch.Tensor | None      # (num_blocks_needed,) int64; None when no context
    mask: Masks | None              # (query_len, seq_len), True = attend; None when no context


@dataclass
class DecodeGroup:
    start: int                       # first decode request (= token row) of the group
    end: int                         # one past its last
    blocks: torch.Tensor             # (group * max_blocks,) int64, padded with block 0
    length: int                      # max_blocks * block_size (padded key length)
    mask: Masks                     # (group, 1, 1, length), True = a real key
    padding: torch.Tensor | None = None  # (group, 1, length, 1), True = not a key; None when every slot is one


@dataclass
class TokenRows:
    """Every token of the step as one query row of the CPU kernel."""

    block_table: torch.Tensor        # (num_tokens, max_blocks) int32: its request's row
    seq_lens: torch.Tensor           # (num_tokens,) int32: its position + 1 (keys it attends)


@dataclass
class SplitRows:
    """The token rows of a step's decodes and short chunks, beside long chunks run elsewhere."""

    others: torch.Tensor             # (tokens,) int64: the token rows of the decodes and short chunks
    other_tokens: TokenRows         # their decode-kernel rows


@dataclass
class PrefillRows:
    """The step's long prefill chunks as the CPU prefill kernel takes them, and, when the
    step also has short ones, its other tokens as decode-kernel rows."""

    block_table: torch.Tensor        # (num_long, max_blocks) int32
    query_start: torch.Tensor        # (num_long + 1,) int32: rows of the long chunks' tokens, from 0
    seq_lens: torch.Tensor           # (num_long,) int32
    rows: torch.Tensor | None = None    # (tokens,) int64: the long chunks' token rows; None: all of q[num_decodes:]
    split: SplitRows | None = None     # with rows: the other token rows (decodes, short chunks)


@dataclass
class TorchPlan:
    decodes: list[DecodeGroup] | None  # None: the decodes run in the CPU kernel
    prefills: list[PrefillChunk]
    num_decodes: int = 0
    tokens: TokenRows | None = None    # set: the whole step is one kernel call
    prefill_rows: PrefillRows | None = None  # set: the prefills run in the prefill kernel
    split: SplitRows | None = None     # set: decodes and short chunks in the decode kernel, long ones in SDPA


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


def plan_prefill_fallback(md: AttentionMetadata, kernel: bool) -> tuple[TokenRows | None, list[PrefillChunk],
                                                                      SplitRows | None]:
    """The prefills' plan without the prefill kernel (``kernel``: the decode kernel runs
    this step): every token a query row of the decode kernel when
    every chunk is short; else one SDPA call per long chunk, and the short chunks'
    tokens decode-kernel rows beside the decodes when the decode kernel runs (their
    alone-bits), or one SDPA call each where it does not."""
    n = md.num_decodes
    if not kernel or n == md.num_reqs:
        return None, plan_prefills(md), None
    long = [i for i in range(n, md.num_reqs) if md.seq_lens_cpu[i] > PREFILL_KERNEL_MAX_LEN]
    if not long:
        return token_rows(md), [], None
    if len(long) == md.num_reqs - n:
        return None, plan_prefills(md), None
    return None, plan_prefills(md, long), split_rows(md, _rows_of(md, long))


def plan_prefills(md: AttentionMetadata, reqs: list[int] | None = None) -> list[PrefillChunk]:
    """One SDPA call's inputs per prefill chunk (or only requests ``reqs``'): gathered
    blocks and a shifted causal mask for a chunk after cached context."""
    device = md.slot_mapping.device
    prefills = []
    for i in range(md.num_decodes, md.num_reqs) if reqs is None else reqs:
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        ctx, seq_len = md.num_computed_tokens_cpu[i], md.seq_lens_cpu[i]
        blocks = mask = None
        if ctx:
            blocks = md.block_table[i, : -(-seq_len // md.block_size)].long()
            q_pos = torch.arange(ctx, seq_len, device=device)
            mask = Masks(torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None])
        prefills.append(PrefillChunk(start, end, seq_len, blocks, mask))
    return prefills


def plan_decodes(md: AttentionMetadata) -> list[DecodeGroup]:
    """The decodes (the first ``num_decodes`` requests) in padded SDPA groups (``decode_groups``)."""
    bs = md.block_size
    num_blocks = [-(-n // bs) for n in md.seq_lens_cpu[: md.num_decodes]]
    bounds = decode_groups(num_blocks, bs)
    groups = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        high = max(num_blocks[start:end])
        key_pos = torch.arange(high * bs, device=md.seq_lens.device)
        allowed = (key_pos[None, :] < md.seq_lens[start:end, None]).view(end - start, 1, 1, high * bs)
        padded = any(n < high * bs for n in md.seq_lens_cpu[start:end])
        groups.append(DecodeGroup(start, end, md.block_table[start:end, :high].reshape(-1).long(),
                                   high * bs, Masks(allowed),
                                   (~allowed).view(end - start, 1, high * bs, 1) if padded else None))
    return groups


def prefill_rows(md: AttentionMetadata) -> PrefillRows:
    """The long prefill chunks' (``seq_len > PREFILL_KERNEL_MAX_LEN``) block table rows,
    query starts (from their first token) and key counts. When the step also has short
    chunks, those and the decodes stay decode-kernel rows (``rows``, ``split``): a short
    prompt gets the same bits whether a long one shares its step or not."""
    n, qsl = md.num_decodes, md.query_start_loc_cpu
    long = [i for i in range(n, md.num_reqs) if md.seq_lens_cpu[i] > PREFILL_KERNEL_MAX_LEN]
    if len(long) == md.num_reqs - n:  # every chunk long: they are the rows from num_decodes on
        starts = md.query_start_loc[n:]
        return PrefillRows(md.block_table[n:], (starts - starts[0]).to(torch.int32), md.seq_lens[n:])
    device = md.query_start_loc.device
    is_long = _rows_of(md, long)
    lens = [qsl[i + 1] - qsl[i] for i in long]
    reqs = torch.tensor(long, dtype=torch.int64, device=device)
    query_start = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=device)
    return PrefillRows(md.block_table.index_select(0, reqs), query_start, md.seq_lens.index_select(0, reqs),
                        is_long.nonzero().squeeze(1).to(device), split_rows(md, is_long))


def _rows_of(md: AttentionMetadata, reqs: list[int]) -> torch.Tensor:
    """``(num_tokens,)`` bool on the CPU: True at the token rows of requests ``reqs``."""
    qsl, rows = md.query_start_loc_cpu, torch.zeros(md.num_tokens, dtype=torch.bool)
    for i in reqs:
        rows[qsl[i]:qsl[i + 1]] = True
    return rows


def split_rows(md: AttentionMetadata, is_long: torch.Tensor) -> SplitRows:
    """The decode-kernel rows of every token not in a long chunk (``is_long`` False)."""
    others = (~is_long).nonzero().squeeze(1).to(md.query_start_loc.device)
    return SplitRows(others, token_rows(md, others))


def token_rows(md: AttentionMetadata, rows: torch.Tensor | None = None) -> TokenRows:
    """Each token's (or only ``rows``') block table row and key count (``position + 1``),
    built with tensor ops (no per-token Python)."""
    query_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    req = torch.repeat_interleave(torch.arange(md.num_reqs, device=query_lens.device), query_lens)
    token = torch.arange(md.num_tokens, dtype=torch.int32, device=query_lens.device)
    if rows is not None:
        req, token = req[rows], token[rows]
    seq_lens = token - md.query_start_loc[req] + md.num_computed_tokens[req] + 1
    return TokenRows(md.block_table.index_select(0, req), seq_lens.to(torch.int32))
