"""The torch attention backend against plain dense causal attention."""

from __future__ import annotations

import pytest
import torch

from executor.attention import available_backends, build_attention_metadata, get_backend
from executor.attention.torch_plan import decode_groups

HEAD_DIM = 32


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> torch.Tensor:
    """Plain attention: ``q`` ``(n, H, D)`` are the last ``n`` positions of a sequence
    whose keys/values ``(context + n, Hkv, D)`` are all given; causal."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * HEAD_DIM**-0.5
    q_pos = torch.arange(context, context + n)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def run_case(block_size: int, num_kv_heads: int, group: int, contexts: list[int], query_lens: list[int]):
    """Writes each request's context with one step, then runs a step with the new
    queries (decodes first) and compares every output row with the reference."""
    torch.manual_seed(block_size * 100 + group * 10 + len(contexts))
    num_heads = num_kv_heads * group
    backend = get_backend("torch")
    seqs = [c + n for c, n in zip(contexts, query_lens)]
    num_blocks = sum(-(-s // block_size) for s in seqs) + 3
    perm = torch.randperm(num_blocks).tolist()  # scattered physical blocks
    blocks, i = [], 0
    for s in seqs:
        nb = -(-s // block_size)
        blocks.append(perm[i:i + nb])
        i += nb
    cache = (torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM) * 100,  # garbage outside the sequences
             torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM) * 100)
    keys = [torch.randn(s, num_kv_heads, HEAD_DIM) for s in seqs]
    values = [torch.randn(s, num_kv_heads, HEAD_DIM) for s in seqs]
    queries = [torch.randn(n, num_heads, HEAD_DIM) for n in query_lens]

    ctx_idx = [r for r, c in enumerate(contexts) if c > 0]
    if ctx_idx:  # step 1: the contexts, as prefills from scratch
        md = build_attention_metadata([contexts[r] for r in ctx_idx], [0] * len(ctx_idx),
                                      [blocks[r] for r in ctx_idx], block_size)
        backend.plan(md)
        q = torch.randn(md.num_tokens, num_heads, HEAD_DIM)
        backend.forward(q, torch.cat([keys[r][: contexts[r]] for r in ctx_idx]),
                        torch.cat([values[r][: contexts[r]] for r in ctx_idx]), cache, md, HEAD_DIM**-0.5)
    order = sorted(range(len(seqs)), key=lambda r: query_lens[r] != 1)
    md = build_attention_metadata([query_lens[r] for r in order], [contexts[r] for r in order],
                                  [blocks[r] for r in order], block_size)
    assert md.num_decodes == sum(1 for n in query_lens if n == 1)
    backend.plan(md)
    out = backend.forward(torch.cat([queries[r] for r in order]),
                          torch.cat([keys[r][contexts[r]:] for r in order]),
                          torch.cat([values[r][contexts[r]:] for r in order]), cache, md, HEAD_DIM**-0.5)
    for row, r in enumerate(order):
        got = out[md.query_start_loc_cpu[row]:md.query_start_loc_cpu[row + 1]]
        want = dense_reference(queries[r], keys[r], values[r], contexts[r])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_from_scratch_ragged(block_size, group):
    b = block_size
    run_case(block_size, 2, group, contexts=[0] * 7, query_lens=[1, 2, b - 1, b, b + 1, 2 * b + 1, 50])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_decodes_and_chunks_after_context(block_size, group):
    b = block_size
    contexts = [1, b - 1, b, b + 1, 3 * b - 1, 7, b, b - 1, 2 * b + 1]
    query_lens = [1, 1, 1, 1, 1, 5, b, 2, b + 1]  # decodes crossing block boundaries, then chunks
    run_case(block_size, 1 if group == 3 else 2, group, contexts, query_lens)


@pytest.mark.parametrize("contexts,query_lens", [
    ([40, 41, 42, 43], [1, 1, 1, 1]),  # decodes only, one group: the output is SDPA's own
    ([0], [37]),                       # one prefill from scratch
    ([45], [20]),                      # one chunk after context
])
def test_batches_of_one_attention_call(contexts, query_lens):
    run_case(16, 2, 3, contexts, query_lens)


def test_decode_groups_trade_padding_for_calls():
    assert decode_groups([], 16) == [0]
    assert decode_groups([5], 16) == [0, 1]
    assert decode_groups([10, 10, 9, 9], 16) == [0, 4]  # padding (2 blocks) is cheaper than a call
    assert decode_groups([40, 40, 2, 2, 2], 16) == [0, 2, 5]  # 76 padded blocks is not
    assert decode_groups([40, 40, 2, 2, 2], 16, group_cost_keys=10**9) == [0, 5]
    assert decode_groups([3, 2, 1], 16, group_cost_keys=0) == [0, 1, 2, 3]


def test_decode_output_does_not_depend_on_its_group(monkeypatch):
    """A decode's output is the same alone and padded in a group with longer requests:
    the padded keys (garbage here) get weight exactly 0; only SDPA's rounding may differ.
    (The padded SDPA path, whatever torch's thread count: the CPU kernel is kept off.)"""
    from executor.attention import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "_loaded", {"fn": None})
    torch.manual_seed(0)
    block_size, num_kv_heads, num_heads = 16, 2, 6
    seqs = [120, 100, 77]  # the request under test is the last, 5 blocks; the first pads it to 8
    blocks, start = [], 0
    for s in seqs:
        blocks.append(list(range(start, start + -(-s // block_size))))
        start += len(blocks[-1])
    shape = (start, block_size, num_kv_heads, HEAD_DIM)
    cache = (torch.randn(shape), torch.randn(shape))
    q = torch.randn(len(seqs), num_heads, HEAD_DIM)
    k, v = torch.randn(2, len(seqs), num_kv_heads, HEAD_DIM)
    backend = get_backend("torch")

    def attend(rows):
        md = build_attention_metadata([1] * len(rows), [seqs[r] - 1 for r in rows], [blocks[r] for r in rows],
                                      block_size)
        backend.plan(md)
        return backend.forward(q[rows], k[rows], v[rows], cache, md, HEAD_DIM**-0.5), md

    together, md = attend([0, 1, 2])
    assert len(md.plan.decodes) == 1  # one group, padded to the longest
    alone, _ = attend([2])
    torch.testing.assert_close(together[2], alone[0], rtol=0, atol=1e-6)


def test_registry():
    assert "torch" in available_backends()
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_metadata_fields():
    md = build_attention_metadata([1, 1, 3], [4, 0, 2], [[5, 6], [2], [7, 8]], block_size=4)
    assert md.query_start_loc.tolist() == [0, 1, 2, 5] and md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == [5, 1, 5] and md.num_decodes == 2
    assert md.slot_mapping.tolist() == [6 * 4 + 0, 2 * 4 + 0, 7 * 4 + 2, 7 * 4 + 3, 8 * 4 + 0]
    assert md.block_table.tolist() == [[5, 6], [2, 0], [7, 8]] and md.block_table.dtype == torch.int32
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([3], [2], [[0]], block_size=4)
    with pytest.raises(ValueError, match="decodes"):
        build_attention_metadata([3, 1], [0, 0], [[0], [1]], block_size=4)
