"""The float32 CPU GEMM (executor/models/cpu_gemm.c through cpu_gemm.py): the panel
packing, exact products where float32 arithmetic is exact, agreement with F.linear on the
model's shapes and on ragged ones (rows past a full tile, columns past a full panel, several
row blocks), bitwise batch invariance, bias and strided inputs, the torch.compile operator,
and the oneDNN packing kept where the kernel is off or torch runs several threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.models import cpu_gemm
from tests.support.kernels import load_fresh, small_ints


@pytest.fixture
def kernel(kernel_cache, monkeypatch, one_thread):
    return load_fresh(cpu_gemm, kernel_cache, monkeypatch, "no C compiler, or no AVX2/FMA on this host")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))



def test_panels_hold_the_weight_columns_in_order_and_zeros_past_the_last(kernel):
    w = _randn(50, 7, seed=0)
    packed = cpu_gemm.pack_panels(w, kernel)
    width = kernel.panel_width
    assert width == 24
    assert packed.shape == (3, 7, 24) and packed.data_ptr() % 64 == 0
    for p in range(3):
        for j in range(width):
            col = p * width + j
            want = w[col] if col < 50 else torch.zeros(7)
            assert torch.equal(packed[p, :, j], want)


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 576, 576), (4, 1536, 576), (5, 64, 24),
                                   (33, 576, 3072), (37, 100, 50), (300, 1536, 200), (129, 2048, 25)])
def test_products_are_exact_where_float32_is(kernel, m, k, n):
    """Every product and partial sum of small integers is exact in float32, so the kernel's
    result must equal the integer product, whatever the tile and block edges."""
    x, w = small_ints(m, k, seed=m), small_ints(n, k, seed=n)
    got = cpu_gemm.panel_linear(x, cpu_gemm.pack_panels(w, kernel), n)
    want = (x.long() @ w.long().T).float()
    assert got.shape == (m, n)
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 2, 7, 32, 150])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (320, 576)])
def test_agrees_with_f_linear_on_the_models_shapes(kernel, m, n, k):
    """SmolLM2-135M's qkv, o, gate_up and down, and a tensor-parallel shard of 320 columns."""
    x, w = _randn(m, k, seed=1), _randn(n, k, seed=2) * k ** -0.5
    got = cpu_gemm.panel_linear(x, cpu_gemm.pack_panels(w, kernel), n)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("m", [1, 5, 32])
def test_agrees_with_f_linear_on_the_lm_head(kernel, m):
    """The 49152-row LM head, on the last token of each request."""
    x, w = _randn(m, 576, seed=1), _randn(49152, 576, seed=2) * 576 ** -0.5
    got = cpu_gemm.panel_linear(x, cpu_gemm.pack_panels(w, kernel), 49152)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=2e-5)


def test_a_row_is_computed_the_same_alone_and_in_any_batch(kernel):
    """Batch invariance: each output is one chain of multiply-adds over the input features,
    so a row's bits do not depend on its neighbours, its place in a 4-row tile or in a row
    block (1536 features: 24 rows a block)."""
    k, n = 1536, 600
    w = _randn(n, k, seed=3) * k ** -0.5
    packed = cpu_gemm.pack_panels(w, kernel)
    x = _randn(70, k, seed=4)
    batch = cpu_gemm.panel_linear(x, packed, n)
    for i in (0, 3, 5, 23, 24, 25, 69):
        assert torch.equal(cpu_gemm.panel_linear(x[i:i + 1], packed, n)[0], batch[i])
    assert torch.equal(cpu_gemm.panel_linear(x[5:40], packed, n), batch[5:40])


def test_linear_adds_the_bias_and_takes_strided_and_batched_inputs(kernel):
    w, b = _randn(100, 64, seed=5), _randn(100, seed=6)
    packed = cpu_gemm.pack(w)
    assert cpu_gemm.is_panel_packed(packed)
    wide = _randn(9, 128, seed=7)
    x = wide[:, ::2]  # rows of 64 with a stride of 2 between features
    torch.testing.assert_close(cpu_gemm.linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    rows = wide[:, :64]  # contiguous features, rows 128 apart
    assert torch.equal(cpu_gemm.linear(rows, w, None, packed), cpu_gemm.linear(rows.contiguous(), w, None, packed))
    x3 = _randn(2, 3, 64, seed=8)
    assert cpu_gemm.linear(x3, w, None, packed).shape == (2, 3, 100)
    assert cpu_gemm.linear(torch.empty(0, 64), w, None, packed).shape == (0, 100)


def test_the_compiled_operator_gives_the_eager_bits(kernel):
    w = _randn(130, 96, seed=9)
    packed = cpu_gemm.pack(w)
    x = _randn(11, 96, seed=10)
    compiled = torch.compile(lambda t: cpu_gemm.linear(t, w, None, packed), backend="inductor", fullgraph=True)
    assert torch.equal(compiled(x), cpu_gemm.linear(x, w, None, packed))


def test_onednn_packing_where_the_kernel_is_off_or_torch_runs_threads(kernel, monkeypatch):
    w = _randn(48, 32, seed=11)
    x = _randn(5, 32, seed=12)
    torch.set_num_threads(2)
    try:
        threaded = cpu_gemm.pack(w)
    finally:
        torch.set_num_threads(1)
    monkeypatch.setattr(cpu_gemm, "_loaded", {"k": None})  # as with MESHSERVE_CPU_GEMM_KERNEL=0
    off = cpu_gemm.pack(w)
    for packed in (threaded, off):
        if not torch.backends.mkldnn.is_available():
            assert packed is None
            continue
        assert packed.is_mkldnn and not cpu_gemm.is_panel_packed(packed)
        torch.testing.assert_close(cpu_gemm.linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_environment_switch_turns_the_kernel_off(kernel_cache, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CPU_GEMM_KERNEL", "0")
    monkeypatch.setattr(cpu_gemm, "_loaded", {})
    assert cpu_gemm.load() is None


@pytest.mark.parametrize("features", [63, 65, 128, 64 * 1000])
def test_a_feature_count_that_does_not_match_the_packed_weight_is_refused(kernel, features):
    """The C kernel trusts its sizes (a longer input would read past the panels): the
    wrapper refuses a mismatch as F.linear does, with a RuntimeError."""
    w = _randn(48, 64, seed=13)
    packed = cpu_gemm.pack(w)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        cpu_gemm.linear(_randn(3, features, seed=14), w, None, packed)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        cpu_gemm.panel_linear(_randn(3, 64, seed=14), packed, 73)  # more columns than its two panels hold
    with pytest.raises(RuntimeError, match="float32"):
        cpu_gemm.panel_linear(_randn(3, 64, seed=14).double(), packed, 48)


def test_a_strided_weight_is_packed_from_its_values(kernel):
    """pack_panels copies a strided weight to contiguous rows and keeps that copy alive
    for the packing call (it used to be freed before the kernel read it)."""
    base = _randn(64, 48, seed=15)
    for w in (base.t(), _randn(96, 64, seed=16)[::2]):
        packed = cpu_gemm.pack_panels(w, kernel)
        x = _randn(5, w.shape[1], seed=17)
        torch.testing.assert_close(cpu_gemm.panel_linear(x, packed, w.shape[0]), F.linear(x, w),
                                   rtol=1e-5, atol=1e-5)


def test_packing_a_weight_that_requires_grad_warns_nothing(kernel, recwarn):
    w = torch.nn.Parameter(_randn(48, 64, seed=18))
    assert cpu_gemm.is_panel_packed(cpu_gemm.pack(w))
    assert [str(w.message) for w in recwarn] == []
