"""The CPU prefill-attention kernel (bfloat16, AVX512-BF16) against float32 attention, its
exact cases, its invariance to chunking and batching, and the backend's use of it."""

import pytest
import torch

from executor.attention import build_attention_metadata, cpu_kernel, cpu_prefill_kernel
from executor.attention.torch_backend import TorchAttentionBackend
from executor.attention.torch_plan import PREFILL_KERNEL_MAX_LEN
from tests.support.kernels import load_fresh, paged_batch


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    return load_fresh(cpu_prefill_kernel, tmp_path, monkeypatch,
                      "no AVX512-BF16 on this CPU (or no C compiler): prefills keep the decode kernel or SDPA")


@pytest.fixture
def backend_takes_it(kernel, monkeypatch):
    """The kernel, which the backend then takes for long chunks even on a CPU with AMX-BF16
    (where it would run them in SDPA: ``cpu_prefill_kernel.preferred``)."""
    monkeypatch.setattr(cpu_prefill_kernel, "preferred", lambda: kernel)
    return kernel


def _reference(q, cache, md, scale):
    """Causal attention in float32 over each request's keys gathered from the cache
    (their bfloat16 values, exactly), ``(tokens, heads, head_dim)`` float32."""
    key_cache, value_cache = cache
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(md.num_reqs):
        start, end = md.query_start_loc_cpu[r], md.query_start_loc_cpu[r + 1]
        seq_len = md.seq_lens_cpu[r]
        slots = [int(md.block_table[r, t // block_size]) * block_size + t % block_size for t in range(seq_len)]
        k = key_cache.view(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        v = value_cache.view(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        positions = torch.arange(seq_len - (end - start), seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _prefill_inputs(md):
    return md.block_table, md.query_start_loc, md.seq_lens


# (9, 3, 64, 16): the default model. The others: head_dim 128; one query head a kv head (48
# tokens a tile); 48 query heads a kv head (one token a tile); 5 a kv head (45 of a tile's 48
# rows used); blocks of 5 and 8 tokens (8-key groups cut by a block edge).
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 8), (48, 1, 64, 16), (10, 2, 64, 5), (6, 2, 128, 32)])
def test_kernel_is_float32_attention_within_bfloat16_rounding(kernel, num_heads, num_kv_heads, head_dim,
                                                              block_size):
    query_lens, contexts = [1, 150, 7, 33, 64, 49], [40, 0, 0, 100, 31, 16]  # a one-token chunk too
    q, _, _, cache, md = paged_batch(query_lens, contexts, num_heads, num_kv_heads, head_dim, block_size,
                                     torch.bfloat16, seed=2)
    got = cpu_prefill_kernel.prefill_attention(kernel, q, *cache, *_prefill_inputs(md), 0.125)
    want = _reference(q, cache, md, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # the probabilities are rounded to bfloat16 (8 bits) before the weighted sum, and the result once more
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert (got.float() - want).abs().mean() < 2e-3


def test_a_query_that_matches_one_earlier_key_returns_its_value_exactly(kernel):
    """Each key a one-hot vector, each query 127 times the one-hot of a key at or before its
    position (all other weights below e^-87, exactly 0): the output is that key's value row,
    bit for bit, whichever block, tile or 32-key block holds it. A masking or paging error
    returns another row."""
    head_dim, block_size, num_heads = 64, 16, 3
    query_lens, contexts = [1, 60, 5], [3, 0, 40]
    _, _, _, cache, md = paged_batch(query_lens, contexts, num_heads, 1, head_dim, block_size, torch.bfloat16,
                                     seed=5)
    key_cache, value_cache = cache
    gen = torch.Generator().manual_seed(6)
    targets, q = [], torch.zeros(sum(query_lens), num_heads, head_dim, dtype=torch.bfloat16)
    for r in range(md.num_reqs):
        start, end, seq_len = md.query_start_loc_cpu[r], md.query_start_loc_cpu[r + 1], md.seq_lens_cpu[r]
        for t in range(seq_len):  # key t of request r: one-hot at feature t (every prefix below 64 keys)
            slot = int(md.block_table[r, t // block_size]) * block_size + t % block_size
            key_cache.view(-1, 1, head_dim)[slot] = torch.nn.functional.one_hot(torch.tensor(t), head_dim)
        for i in range(start, end):
            position = seq_len - (end - i)
            for h in range(num_heads):
                t = int(torch.randint(0, position + 1, (1,), generator=gen))
                q[i, h, t] = 127.0
                slot = int(md.block_table[r, t // block_size]) * block_size + t % block_size
                targets.append((i, h, value_cache.view(-1, 1, head_dim)[slot, 0].clone()))
    got = cpu_prefill_kernel.prefill_attention(kernel, q, *cache, *_prefill_inputs(md), 1.0)
    for i, h, want in targets:
        assert torch.equal(got[i, h], want), (i, h)


def test_uniform_scores_give_the_running_mean_of_the_values(kernel):
    """Equal keys (every score the same, every probability exactly 1): token i's output is
    the mean of the values at positions 0 .. i (small integers: exact sums), rounded."""
    head_dim, block_size = 64, 16
    _, _, _, cache, md = paged_batch([100], [0], 3, 3, head_dim, block_size, torch.bfloat16, seed=7)
    key_cache, value_cache = cache
    key_cache.fill_(0.5)
    values = torch.randint(-8, 9, value_cache.shape, generator=torch.Generator().manual_seed(8))
    value_cache.copy_(values.to(torch.bfloat16))
    q = torch.randn(100, 3, head_dim, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = cpu_prefill_kernel.prefill_attention(kernel, q, *cache, *_prefill_inputs(md), 0.125)
    slots = [int(md.block_table[0, t // block_size]) * block_size + t % block_size for t in range(100)]
    v = value_cache.view(-1, 3, head_dim)[slots].double()
    want = (v.cumsum(0) / torch.arange(1, 101, dtype=torch.float64)[:, None, None]).float()
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2 ** -7, atol=0)


def test_a_token_gets_the_same_bits_in_a_whole_prefill_in_chunks_and_in_any_batch(kernel):
    """Key blocks at absolute positions and masked keys adding exact zeros: a 150-token
    prompt prefilled whole, in chunks of 37 after cached context, or beside other requests
    gives every token the same output bits."""
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    q, _, _, cache, md = paged_batch([150, 20, 3], [0, 70, 5], num_heads, num_kv_heads, head_dim, block_size,
                                     torch.bfloat16, seed=11)
    batch = cpu_prefill_kernel.prefill_attention(kernel, q, *cache, *_prefill_inputs(md), 0.125)
    blocks = md.block_table[0, : -(-150 // block_size)].tolist()
    alone = build_attention_metadata([150], [0], [blocks], block_size)
    whole = cpu_prefill_kernel.prefill_attention(kernel, q[:150], *cache, *_prefill_inputs(alone), 0.125)
    assert torch.equal(whole, batch[:150])
    for start in range(0, 150, 37):
        end = min(150, start + 37)
        chunk = build_attention_metadata([end - start], [start], [blocks], block_size)
        got = cpu_prefill_kernel.prefill_attention(kernel, q[start:end], *cache, *_prefill_inputs(chunk), 0.125)
        assert torch.equal(got, whole[start:end]), start


def test_shapes_it_does_not_take_are_refused_not_computed(kernel):
    q, _, _, cache, md = paged_batch([4], [0], 4, 2, 32, 16, torch.bfloat16)
    assert not cpu_prefill_kernel.supports(q, cache[0])
    with pytest.raises(ValueError, match="does not take 4 heads over 2 kv heads of 32"):
        cpu_prefill_kernel.prefill_attention(kernel, q, *cache, *_prefill_inputs(md), 0.125)
    q64, _, _, cache64, _ = paged_batch([4], [0], 4, 2, 64, 16, torch.bfloat16)
    assert not cpu_prefill_kernel.supports(q64.float(), cache64[0].float())  # float32: the other paths


def test_the_switch_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MESHSERVE_CPU_PREFILL_KERNEL", "0")
    monkeypatch.setattr(cpu_prefill_kernel, "_loaded", {})
    assert cpu_prefill_kernel.load() is None
    assert not list(tmp_path.glob("kernels/cpu_prefill_attention-*.so"))


def test_backend_runs_decodes_in_the_decode_kernel_and_prefills_in_the_prefill_kernel(backend_takes_it, one_thread):
    """A bfloat16 step of 3 decodes and 2 long prefill chunks: one call of each kernel, the
    decode rows bitwise the decode kernel's, the prefill rows the prefill kernel's, all
    close to float32 attention; a float32 step falls back and says so in its plan."""
    kernel, decode_kernel = backend_takes_it, cpu_kernel.load()
    if decode_kernel is None:
        pytest.skip("no decode kernel")
    query_lens, contexts = [1, 1, 1, 7, 400], [40, 17, 2, 380, 9]
    q, k, v, cache, md = paged_batch(query_lens, contexts, 9, 3, 64, 16, torch.bfloat16, seed=3)
    backend = TorchAttentionBackend()
    backend.plan(md)
    assert md.plan.prefill_rows is not None and md.plan.tokens is None and md.plan.prefills == []
    assert md.plan.prefill_rows.query_start.tolist() == [0, 7, 407]
    got = backend.forward(q, k, v, cache, md, 0.125)
    decoded = cpu_kernel.decode_attention(decode_kernel, q[:3], *cache, md.block_table[:3], md.seq_lens[:3], 0.125)
    assert torch.equal(got[:3], decoded)
    prefilled = cpu_prefill_kernel.prefill_attention(kernel, q[3:], *cache, md.block_table[3:],
                                                     md.query_start_loc[3:] - 3, md.seq_lens[3:], 0.125)
    assert torch.equal(got[3:], prefilled)
    torch.testing.assert_close(got.float(), _reference(q, cache, md, 0.125), rtol=2e-2, atol=2e-2)

    q32, k32, v32, cache32, md32 = paged_batch(query_lens, contexts, 9, 3, 64, 16, torch.float32, seed=3)
    backend.plan(md32)
    backend.forward(q32, k32, v32, cache32, md32, 0.125)
    assert md32.plan.prefill_rows is None and md32.plan.prefills  # SDPA: a chunk is over PREFILL_KERNEL_MAX_LEN
    backend.plan(md32)
    assert md32.plan.prefill_rows is None  # later plans know


def test_backend_keeps_short_bfloat16_prefills_as_decode_kernel_rows(backend_takes_it, one_thread):
    """A bfloat16 step whose chunks are all at most PREFILL_KERNEL_MAX_LEN tokens (context
    included) keeps one decode-kernel call with every prompt token a query row: each prompt
    token's output is bitwise its decode, so a prompt gets the same bits cached or not,
    chunked or not (the prefill kernel rounds its probabilities to bfloat16: it would not)."""
    decode_kernel = cpu_kernel.load()
    if decode_kernel is None:
        pytest.skip("no decode kernel")
    query_lens, contexts = [1, 1, 30, PREFILL_KERNEL_MAX_LEN - 9], [40, 17, 0, 9]
    q, k, v, cache, md = paged_batch(query_lens, contexts, 9, 3, 64, 16, torch.bfloat16, seed=4)
    backend = TorchAttentionBackend()
    backend.plan(md)
    assert md.plan.prefill_rows is None and md.plan.tokens is not None
    got = backend.forward(q, k, v, cache, md, 0.125)
    for row, (request, keys) in {0: (0, 41), 2: (2, 1), 31: (2, 30), 32: (3, 10), 406: (3, 384)}.items():
        alone = cpu_kernel.decode_attention(decode_kernel, q[row:row + 1], *cache,
                                            md.block_table[request:request + 1],
                                            torch.tensor([keys], dtype=torch.int32), 0.125)
        assert torch.equal(alone[0], got[row]), row


def test_backend_keeps_short_chunks_beside_a_long_one_as_decode_kernel_rows(backend_takes_it, one_thread):
    """A bfloat16 step with long chunks (past PREFILL_KERNEL_MAX_LEN) and short ones: only the
    long ones go to the prefill kernel (each bitwise its run alone); the decodes and the short
    chunks keep the decode kernel's rows, so a short prompt's bits do not depend on whether a
    long prompt shares its step."""
    kernel, decode_kernel = backend_takes_it, cpu_kernel.load()
    if decode_kernel is None:
        pytest.skip("no decode kernel")
    query_lens, contexts = [1, 1, 30, 400, 20, 500, 7], [40, 3, 0, 0, 100, 0, 377]
    q, k, v, cache, md = paged_batch(query_lens, contexts, 9, 3, 64, 16, torch.bfloat16, seed=7)
    backend = TorchAttentionBackend()
    backend.plan(md)
    assert md.plan.prefill_rows.query_start.tolist() == [0, 400, 900]
    got = backend.forward(q, k, v, cache, md, 0.125)
    for r in range(md.num_reqs):
        start, end = md.query_start_loc_cpu[r], md.query_start_loc_cpu[r + 1]
        if md.seq_lens_cpu[r] > PREFILL_KERNEL_MAX_LEN:
            alone = cpu_prefill_kernel.prefill_attention(kernel, q[start:end], *cache, md.block_table[r:r + 1],
                                                         torch.tensor([0, end - start], dtype=torch.int32),
                                                         md.seq_lens[r:r + 1], 0.125)
            assert torch.equal(alone, got[start:end]), r
            continue
        for row in range(start, end):
            keys = torch.tensor([contexts[r] + row - start + 1], dtype=torch.int32)
            alone = cpu_kernel.decode_attention(decode_kernel, q[row:row + 1], *cache, md.block_table[r:r + 1],
                                                keys, 0.125)
            assert torch.equal(alone[0], got[row]), (r, row)
    torch.testing.assert_close(got.float(), _reference(q, cache, md, 0.125), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("amx", [True, False])
def test_the_backend_runs_long_chunks_in_sdpa_on_a_cpu_with_amx_and_in_the_kernel_without(kernel, one_thread,
                                                                                           monkeypatch, amx):
    """With AMX-BF16, ATen's flash attention (SDPA) multiplies on AMX tiles and is 1.9-2.8x
    the kernel for long chunks (one Sapphire Rapids core), so the backend runs them there;
    without it (Zen 4: the kernel 3-3.8x SDPA) in the kernel. The short chunks stay the
    decode kernel's rows either way."""
    flags = "fpu avx2 avx512f avx512bw avx512_bf16" + (" amx_tile amx_bf16" if amx else "")
    monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda: flags)
    assert (cpu_prefill_kernel.preferred() is None) == amx
    query_lens, contexts = [1, 30, 400], [40, 0, 9]
    q, k, v, cache, md = paged_batch(query_lens, contexts, 9, 3, 64, 16, torch.bfloat16, seed=5)
    backend = TorchAttentionBackend()
    backend.plan(md)
    if amx:
        assert md.plan.prefill_rows is None and [(c.start, c.end) for c in md.plan.prefills] == [(31, 431)]
    else:
        assert md.plan.prefill_rows.query_start.tolist() == [0, 400] and md.plan.prefills == []
    got = backend.forward(q, k, v, cache, md, 0.125)
    torch.testing.assert_close(got.float(), _reference(q, cache, md, 0.125), rtol=2e-2, atol=2e-2)
    decode_kernel = cpu_kernel.load()
    for row, keys in ((1, 1), (30, 30)):  # the 30-token prompt's first and last rows: their decodes' bits
        alone = cpu_kernel.decode_attention(decode_kernel, q[row:row + 1], *cache, md.block_table[1:2],
                                            torch.tensor([keys], dtype=torch.int32), 0.125)
        assert torch.equal(alone[0], got[row]), row
