"""The CPU paged decode-attention kernel against the padded SDPA path it replaces."""

import pytest
import torch

from executor.attention import cpu_kernel
from executor.attention.torch_backend import TorchAttentionBackend
from tests.support.kernels import paged_batch as _batch
from tests.support.kernels import run_fresh_process


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    fn = cpu_kernel.load()
    if fn is None:
        pytest.skip("no C compiler on this host: the backend keeps its SDPA path")
    return fn


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 1),
                                                                           (8, 2, 16, 5)])
def test_kernel_equals_the_padded_sdpa_path_in_float32(kernel, num_heads, num_kv_heads, head_dim, block_size):
    contexts = [0, 1, 15, 16, 17, 40, 99, 3]
    q, k, v, cache, md = _batch([1] * len(contexts), contexts, num_heads, num_kv_heads, head_dim, block_size,
                                torch.float32)
    want = TorchAttentionBackend().forward(q, k, v, cache, md, 0.3)  # threads > 1 or not: writes the cache too
    got = cpu_kernel.decode_attention(kernel, q, *cache, md.block_table, md.seq_lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# (9, 3, 64, 16): the default model; the others walk the AVX512-BF16 path's edges where the CPU has
# it (head_dim 32/128/256, 16-key groups cut by the block or the context, 1-6 query heads a KV
# head, value accumulators in blocks of 4, 2 or 1 heads); head_dim 16 takes the plain C path.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (8, 2, 128, 16), (12, 2, 64, 32), (4, 4, 32, 5), (6, 1, 256, 16), (8, 2, 16, 5)])
def test_kernel_in_bfloat16_is_the_float32_result_rounded(kernel, num_heads, num_kv_heads, head_dim, block_size):
    contexts = [5, 30, 64, 130, 0, 15, 16, 47]
    q, k, v, cache, md = _batch([1] * len(contexts), contexts, num_heads, num_kv_heads, head_dim, block_size,
                                torch.float32, seed=1)
    TorchAttentionBackend().forward(q, k, v, cache, md, 0.125)  # fills this step's keys into the cache
    exact = cpu_kernel.decode_attention(kernel, q.bfloat16().float(), cache[0].bfloat16().float(),
                                        cache[1].bfloat16().float(), md.block_table, md.seq_lens, 0.125)
    got = cpu_kernel.decode_attention(kernel, q.bfloat16(), cache[0].bfloat16(), cache[1].bfloat16(),
                                      md.block_table, md.seq_lens, 0.125)
    assert got.dtype == torch.bfloat16
    # one bfloat16 rounding of the float32 result, which sums in another order: at most one unit
    # in the last place apart
    torch.testing.assert_close(got.float(), exact.bfloat16().float(), rtol=2 ** -7, atol=2 ** -7)
    assert torch.equal(got[4], cache[1].bfloat16()[md.block_table[4, 0], 0].repeat_interleave(
        num_heads // num_kv_heads, dim=0))  # one key: the output is its value row, exactly


def test_kernel_in_bfloat16_is_batch_invariant(kernel):
    q, k, v, cache, md = _batch([1] * 6, [3, 50, 7, 120, 16, 33], 9, 3, 64, 16, torch.float32, seed=3)
    TorchAttentionBackend().forward(q, k, v, cache, md, 0.125)
    q, cache = q.bfloat16(), (cache[0].bfloat16(), cache[1].bfloat16())
    together = cpu_kernel.decode_attention(kernel, q, *cache, md.block_table, md.seq_lens, 0.125)
    for i in range(6):
        alone = cpu_kernel.decode_attention(kernel, q[i:i + 1], *cache, md.block_table[i:i + 1],
                                            md.seq_lens[i:i + 1], 0.125)
        assert torch.equal(alone[0], together[i])


def test_on_a_cpu_with_amx_the_bfloat16_scores_are_multiplied_on_tiles(kernel):
    """Where the CPU has AMX-BF16 the kernel takes its tile path (the bit-for-bit tests above
    then check it), and says so; elsewhere it does not claim it."""
    assert cpu_kernel.scores_on_amx() == ("amx_bf16" in cpu_kernel.cpu_flags().split())


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_a_softmax_saturated_on_one_key_returns_that_keys_value_row_exactly(kernel, head_dim):
    """One key's score 200 above the rest (their weights e^-200: zero in float32): the output
    is that key's value row, bit for bit, for a decode and for a prompt's rows taken together,
    wherever the key falls among 16-key groups and blocks."""
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, length = 6, 16, 70
    key_cache = torch.randn(num_blocks, block_size, 1, head_dim, generator=gen).bfloat16() * 0.01
    value_cache = torch.randn(num_blocks, block_size, 1, head_dim, generator=gen).bfloat16()
    table = torch.tensor([[3, 0, 5, 1, 4, 2]], dtype=torch.int32)
    q = torch.zeros(length, 1, head_dim, dtype=torch.bfloat16)
    q[:, 0, 0] = 100.0
    for hot in (0, 15, 16, 37, 69):
        keys = key_cache.clone()
        block, slot = table[0, hot // block_size], hot % block_size
        keys[block, slot, 0, 0] = 4.0  # a score of 4 * 100 * 0.5 = 200 against at most 0.5
        rows = cpu_kernel.decode_attention(kernel, q[hot:], keys, value_cache, table.expand(length - hot, 6),
                                           torch.arange(hot + 1, length + 1, dtype=torch.int32), 0.5)
        want = value_cache[block, slot, 0]
        for i in range(length - hot):
            assert torch.equal(rows[i, 0].view(torch.int16), want.view(torch.int16)), (hot, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_key_in_the_context_makes_the_rows_that_see_it_nan(kernel, dtype):
    """A NaN in a cached key (a corrupt cache, an overflowed projection) is not hidden: every
    row whose keys include it comes out NaN in the heads of its kv head, as SDPA's would, for a
    decode and for a prompt's rows taken together; the rows before it and the other kv head's
    heads stay finite."""
    gen = torch.Generator().manual_seed(9)
    length, bad = 40, 21
    key_cache = torch.randn(3, 16, 2, 64, generator=gen).to(dtype)
    value_cache = torch.randn(3, 16, 2, 64, generator=gen).to(dtype)
    key_cache[bad // 16, bad % 16, 0, 7] = float("nan")
    q = torch.randn(length, 4, 64, generator=gen).to(dtype)  # heads 0-1 read kv head 0, heads 2-3 kv head 1
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32).expand(length, 3)
    rows = cpu_kernel.decode_attention(kernel, q, key_cache, value_cache, table,
                                       torch.arange(1, length + 1, dtype=torch.int32), 0.125)
    for i in range(length):  # row i holds keys 0..i
        assert bool(rows[i, :2].isnan().all()) == (i >= bad), i
        assert not bool(rows[i, :2].isnan().any()) or i >= bad
        assert bool(rows[i, 2:].isfinite().all()), i


def test_tensors_that_do_not_fit_together_are_refused_before_the_kernel_reads_them(kernel):
    """The C kernel trusts its sizes (fewer seq_lens or block-table rows than queries would be
    read past their ends): the wrapper refuses each mismatch with a RuntimeError, as a torch op
    does, and the valid call still gives the same output."""
    q, k, v, cache, md = _batch([1] * 4, [3, 50, 7, 20], 9, 3, 64, 16, torch.float32, seed=4)
    TorchAttentionBackend().forward(q, k, v, cache, md, 0.125)
    bt, lens = md.block_table, md.seq_lens
    want = cpu_kernel.decode_attention(kernel, q, *cache, bt, lens, 0.125)
    kc, vc = cache
    bad = {
        "seq_lens": (q, kc, vc, bt, lens[:3], None),
        "int64 seq_lens": (q, kc, vc, bt, lens.long(), None),
        "block_table": (q, kc, vc, bt[:3], lens, None),
        "int64 block_table": (q, kc, vc, bt.long(), lens, None),
        "transposed block_table": (q, kc, vc, bt.t().contiguous().t(), lens, None),
        "head_dim": (q[..., :32].contiguous(), kc, vc, bt, lens, None),
        "kv_heads": (q[:, :8].contiguous(), kc, vc, bt, lens, None),
        "value_cache": (q, kc, vc[:, :8].contiguous(), bt, lens, None),
        "dtype": (q.bfloat16(), kc, vc, bt, lens, None),
        "q dims": (q.reshape(4, -1), kc, vc, bt, lens, None),
        "out rows": (q, kc, vc, bt, lens, torch.empty(3, 9, 64)),
        "out dtype": (q, kc, vc, bt, lens, torch.empty(4, 9, 64, dtype=torch.bfloat16)),
    }
    for qq, kk, vv, table, seq, out in bad.values():
        with pytest.raises(RuntimeError, match="decode attention takes|decode attention writes"):
            cpu_kernel.decode_attention(kernel, qq, kk, vv, table, seq, 0.125, out)
    assert torch.equal(cpu_kernel.decode_attention(kernel, q, *cache, bt, lens, 0.125), want)


def test_kernel_is_batch_invariant(kernel):
    q, k, v, cache, md = _batch([1] * 6, [3, 50, 7, 120, 16, 33], 9, 3, 64, 16, torch.float32, seed=2)
    TorchAttentionBackend().forward(q, k, v, cache, md, 0.125)
    together = cpu_kernel.decode_attention(kernel, q, *cache, md.block_table, md.seq_lens, 0.125)
    for i in range(6):
        alone = cpu_kernel.decode_attention(kernel, q[i:i + 1], *cache, md.block_table[i:i + 1],
                                            md.seq_lens[i:i + 1], 0.125)
        assert torch.equal(alone[0], together[i])


def _token_rows(prompts, num_heads, num_kv_heads, head_dim, block_size, seed):
    """Every token of ``prompts`` ((context, new tokens, request) each; requests named alike
    share their blocks) as a query row of the kernel: ``(q, key_cache, value_cache,
    block_table, seq_lens)`` in bfloat16, the rows in order, blocks scattered."""
    gen = torch.Generator().manual_seed(seed)
    longest = {}
    for context, new, name in prompts:
        longest[name] = max(longest.get(name, 0), context + new)
    need = {name: -(-n // block_size) for name, n in longest.items()}
    perm = torch.randperm(sum(need.values()) + 3, generator=gen).tolist()
    blocks, width, i = {}, max(need.values()) + 2, 0
    for name, n in need.items():
        blocks[name] = perm[i:i + n] + [perm[-1]] * (width - n)  # padding past its own blocks
        i += n
    shape = (len(perm), block_size, num_kv_heads, head_dim)
    cache = [torch.randn(shape, generator=gen).bfloat16() for _ in range(2)]
    rows = [(name, context + j + 1) for context, new, name in prompts for j in range(new)]
    q = torch.randn(len(rows), num_heads, head_dim, generator=gen).bfloat16()
    table = torch.tensor([blocks[name] for name, _ in rows], dtype=torch.int32)
    seq_lens = torch.tensor([length for _, length in rows], dtype=torch.int32)
    return q, cache[0], cache[1], table, seq_lens


# A prompt's tokens are consecutive rows with one key more each over the same blocks: the kernel
# takes up to 16 such rows together (each key and value row read once for them) in bfloat16.
# Geometries: value accumulators of 3 heads (9/3), 3 + 3 (12/2), 2 (8/4), 3 + 1 (8/2) for two
# rows at once; head_dim 128 and 32 take the prompt's rows together for the scores only.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (12, 2, 64, 32), (8, 4, 64, 5), (8, 2, 64, 16), (8, 2, 128, 16), (4, 4, 32, 1)])
def test_a_prompts_rows_taken_together_get_the_bits_each_gets_alone(kernel, num_heads, num_kv_heads, head_dim,
                                                                   block_size):
    prompts = [(40, 1, "decode"), (0, 37, "prompt"), (17, 2, "chunk"), (0, 1, "one"), (63, 5, "late"),
               (6, 4, "shared"), (10, 3, "shared"), (90, 1, "decode2"), (0, 3, "three")]
    q, key_cache, value_cache, table, seq_lens = _token_rows(prompts, num_heads, num_kv_heads, head_dim,
                                                             block_size, seed=4)
    together = cpu_kernel.decode_attention(kernel, q, key_cache, value_cache, table, seq_lens, 0.125)
    for i in range(q.shape[0]):
        alone = cpu_kernel.decode_attention(kernel, q[i:i + 1], key_cache, value_cache, table[i:i + 1],
                                            seq_lens[i:i + 1], 0.125)
        assert torch.equal(alone[0].view(torch.int16), together[i].view(torch.int16)), i


def _sdpa_reference(query_lens, contexts, monkeypatch, seed):
    """The step through the backend without the kernel: padded SDPA decodes, SDPA prefills."""
    monkeypatch.setenv("MESHSERVE_CPU_ATTENTION_KERNEL", "0")
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    q, k, v, cache, md = _batch(query_lens, contexts, 9, 3, 64, 16, torch.float32, seed=seed)
    reference = TorchAttentionBackend()
    reference.plan(md)
    assert md.plan.decodes is not None and md.plan.tokens is None  # the padded SDPA path
    return reference.forward(q, k, v, cache, md, 0.125), cache


def test_backend_on_one_thread_runs_a_step_of_short_prefills_as_one_kernel_call(kernel, one_thread, monkeypatch):
    """Decodes and prefill chunks up to PREFILL_KERNEL_MAX_LEN tokens: every token is one
    query row of the kernel over its own prefix (causal attention, no mask), close to SDPA,
    and each prefill token's row is bitwise the kernel's decode of that token alone."""
    query_lens, contexts = [1, 1, 1, 7, 20], [40, 17, 2, 0, 9]
    q, k, v, cache, md = _batch(query_lens, contexts, 9, 3, 64, 16, torch.float32, seed=3)
    backend = TorchAttentionBackend()
    backend.plan(md)
    got = backend.forward(q, k, v, cache, md, 0.125)  # float32: not the bfloat16 prefill kernel's
    assert md.plan.tokens is not None and md.plan.tokens.seq_lens.tolist() == [
        41, 18, 3, *range(1, 8), *range(10, 30)]
    want, ref_cache = _sdpa_reference(query_lens, contexts, monkeypatch, seed=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])
    for row, (request, length) in {3: (3, 1), 9: (3, 7), 10: (4, 10), 29: (4, 29)}.items():
        alone = cpu_kernel.decode_attention(kernel, q[row:row + 1], *cache, md.block_table[request:request + 1],
                                            torch.tensor([length], dtype=torch.int32), 0.125)
        assert torch.equal(alone[0], got[row])


def test_backend_on_one_thread_runs_long_prefills_in_sdpa_and_the_other_tokens_in_the_kernel(kernel, one_thread,
                                                                                             monkeypatch):
    """A long chunk (past PREFILL_KERNEL_MAX_LEN) runs in SDPA; the decodes and the short
    chunk beside it stay kernel rows, each bitwise the kernel's decode of that token alone
    (so the short prompt gets the bits it gets without the long one)."""
    from executor.attention.torch_plan import PREFILL_KERNEL_MAX_LEN

    query_lens, contexts = [1, 1, 1, 7, PREFILL_KERNEL_MAX_LEN], [40, 17, 2, 0, 9]
    q, k, v, cache, md = _batch(query_lens, contexts, 9, 3, 64, 16, torch.float32, seed=3)
    backend = TorchAttentionBackend()
    backend.plan(md)
    got = backend.forward(q, k, v, cache, md, 0.125)  # float32: not the bfloat16 prefill kernel's
    plan = md.plan
    assert plan.decodes is None and plan.num_decodes == 3 and plan.tokens is None and plan.prefill_rows is None
    assert plan.split.others.tolist() == list(range(10)) and [(p.start, p.end) for p in plan.prefills] == [(10, 394)]
    assert plan.split.other_tokens.seq_lens.tolist() == [41, 18, 3, *range(1, 8)]
    want, ref_cache = _sdpa_reference(query_lens, contexts, monkeypatch, seed=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[10:], want[10:])  # the long chunk: the same SDPA call
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])
    for row, (request, length) in {0: (0, 41), 3: (3, 1), 9: (3, 7)}.items():
        alone = cpu_kernel.decode_attention(kernel, q[row:row + 1], *cache, md.block_table[request:request + 1],
                                            torch.tensor([length], dtype=torch.int32), 0.125)
        assert torch.equal(alone[0], got[row])


def test_a_prefill_only_step_uses_the_kernel_when_short_and_sdpa_when_long(kernel, one_thread, monkeypatch):
    for query_lens, contexts, in_kernel in (([5, 12], [0, 30], True), ([400], [0], False)):
        q, k, v, cache, md = _batch(query_lens, contexts, 9, 3, 64, 16, torch.float32, seed=4)
        backend = TorchAttentionBackend()
        backend.plan(md)
        got = backend.forward(q, k, v, cache, md, 0.125)
        assert (md.plan.tokens is not None) is in_kernel and md.plan.decodes == []
        with monkeypatch.context() as m:
            want, _ = _sdpa_reference(query_lens, contexts, m, seed=4)
            m.setattr(cpu_kernel, "_loaded", {})
        if in_kernel:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)


def test_no_working_compiler_keeps_the_sdpa_path(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    assert cpu_kernel.load() is None
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").glob("*.so"))
    q, k, v, cache, md = _batch([1, 1], [4, 30], 4, 2, 16, 16, torch.float32)
    backend = TorchAttentionBackend()
    backend.plan(md)
    assert md.plan.decodes is not None
    assert backend.forward(q, k, v, cache, md, 0.25).shape == (2, 4, 16)


def test_the_built_kernel_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    if cpu_kernel.load() is None:
        pytest.skip("no C compiler on this host")
    [built] = (tmp_path / "kernels").glob("cpu_paged_attention-*.so")
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setattr(cpu_kernel, "build", lambda *a: pytest.fail("rebuilt a cached kernel"))
    assert cpu_kernel.load() is not None
    assert list((tmp_path / "kernels").glob("cpu_paged_attention-*.so")) == [built]


def test_loading_the_kernels_leaves_the_process_rounding_of_tiny_numbers_alone(tmp_path):
    """Built and loaded fresh in a new process: a denormal product stays a denormal after
    each C kernel loads. A library linked with ``-ffast-math`` turns on flush-to-zero for
    the thread that loads it (GCC's ``crtfastmath.o``): the attention kernel did, which
    changed every later torch op of that thread (and of threads it started)."""
    script = (
        "import torch\n"
        "from executor.attention import cpu_kernel\n"
        "from executor.models import cpu_fused, cpu_gemm\n"
        "tiny = lambda: (torch.tensor([1e-38]) * 0.1).item()\n"
        "before = tiny()\n"
        "loaded = [cpu_kernel.load() is not None, cpu_fused.load() is not None, cpu_gemm.load() is not None]\n"
        "print(before, tiny(), *loaded)\n")
    before, after, *loaded = run_fresh_process(script, tmp_path).split()
    if loaded[0] != "True":
        pytest.skip("no C compiler on this host")
    assert float(before) == float(after) == pytest.approx(1e-39, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_non_finite_values_past_a_requests_keys_do_not_reach_the_sdpa_decode(dtype):
    """The padded SDPA path (several threads, float16, no compiler) gathers whole blocks: the
    slots past a request's keys hold what their earlier owner left. A NaN or inf there (a
    request that overflowed) must not survive the mask (NaN + -inf, 0 * NaN): the output
    equals that of a clean cache, bitwise, for the decodes beside it too."""
    q, k, v, cache, md = _batch([1, 1, 1], [4, 30, 9], 4, 2, 64, 16, dtype, seed=6)
    assert md.block_table.tolist() == [[2, 0], [4, 5], [3, 0]]  # block 0 holds no key: padding only
    clean = (cache[0].clone(), cache[1].clone())
    for row, first_stale in ((0, 5), (2, 10)):  # past each request's seq_len, in its last block
        block = int(md.block_table[row, 0])
        cache[0][block, first_stale:] = float("nan")
        cache[1][block, first_stale:] = float("inf")
    cache[0][0] = float("nan")  # block 0 pads the short requests' block rows in their group
    cache[1][0] = float("-inf")
    backend = TorchAttentionBackend()
    backend._kernel = None  # the padded SDPA path
    backend.plan(md)
    assert md.plan.decodes is not None
    stale_out = backend.forward(q, k, v, cache, md, 0.125)
    md.plan = None
    backend.plan(md)
    want = backend.forward(q, k, v, clean, md, 0.125)
    assert not stale_out.isnan().any() and torch.equal(stale_out, want)
