"""Per-step attention metadata: one dataclass, built once by the ModelRunner and
passed explicitly to every attention layer.

The batch is flattened and unpadded: the tokens of request ``i`` are rows
``query_start_loc[i] : query_start_loc[i + 1]`` of ``q``/``k``/``v``. Requests are
ordered decodes first (``query_len == 1``), then prefill chunks, so a backend can
treat the first ``num_decodes`` requests as one padded batch::

    tokens:   | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
    requests:   0    1    2    3             4         num_decodes = 3

For request ``i``, ``num_computed_tokens[i]`` tokens were already in the paged
cache before this step; this step writes ``query_len = seq_lens[i] -
num_computed_tokens[i]`` more, at the cache slots ``slot_mapping`` gives, and
every query attends causally to all ``seq_lens[i]`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to, for one step.

    Attributes:
        num_reqs: requests in the batch.
        num_tokens: tokens in the flattened batch (sum of query lengths).
        num_decodes: the first ``num_decodes`` requests have exactly one query token.
        max_query_len: longest query (tokens) of any request this step.
        max_seq_len: longest ``seq_lens`` entry (tokens).
        block_size: tokens per KV block.
        query_start_loc: ``(num_reqs + 1,)`` int32, cumulative query lengths;
            ``query_start_loc[0] == 0``, ``query_start_loc[-1] == num_tokens``.
        seq_lens: ``(num_reqs,)`` int32, tokens of each request in the cache after
            this step's writes (context + query).
        num_computed_tokens: ``(num_reqs,)`` int32, tokens of each request already
            in the cache before this step (the context).
        slot_mapping: ``(num_tokens,)`` int64, flat cache slot of each new token:
            ``block_id * block_size + offset_in_block``.
        block_table: ``(num_reqs, max_num_blocks_per_req)`` int32, physical block
            ids of each request in logical order; padded with 0 (never read
            unmasked).
        query_start_loc_cpu / seq_lens_cpu / num_computed_tokens_cpu: the same
            values as Python lists, so per-request loops need no device sync.
        plan: backend-specific precomputation for this step (e.g. gather indices and
            masks), made once by ``AttentionBackend.plan`` and reused by every layer.
    """

    num_reqs: int
    num_tokens: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_computed_tokens_cpu: list[int]
    plan: Any = field(default=None, repr=False)


def build_attention_metadata(
    query_lens: list[int],
    num_computed_tokens: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Builds the metadata of a batch whose requests are already ordered decodes first.

    Args:
        query_lens: new tokens per request (each >= 1).
        num_computed_tokens: tokens per request already in the cache.
        block_ids: each request's physical blocks in logical order; they must
            cover ``num_computed_tokens + query_len`` tokens.
        block_size: tokens per block.

    Raises:
        ValueError: a request's blocks do not cover its tokens, or a decode follows
            a prefill chunk.
    """
    import numpy as np

    num_reqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(num_computed_tokens, dtype=np.int64)
    seq = ctx + q_lens
    num_decodes = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else num_reqs
    if (q_lens[num_decodes:] == 1).any():
        raise ValueError("requests must be ordered decodes (query_len 1) first")
    max_blocks = max(len(b) for b in block_ids)
    table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, blocks in enumerate(block_ids):
        if len(blocks) * block_size < seq[i]:
            raise ValueError(f"request {i}: {len(blocks)} blocks cannot hold {seq[i]} tokens")
        table[i, : len(blocks)] = blocks
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    positions = np.arange(num_tokens) - qsl[req_of_token] + ctx[req_of_token]
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        num_decodes=num_decodes,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq.max()),
        block_size=block_size,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq.astype(np.int32)).to(device),
        num_computed_tokens=torch.from_numpy(ctx.astype(np.int32)).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        block_table=torch.from_numpy(table.astype(np.int32)).to(device),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq.tolist(),
        num_computed_tokens_cpu=ctx.tolist(),
    )
