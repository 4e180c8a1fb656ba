"""The bfloat16 CPU GEMMs (executor/models/cpu_gemm_bf16.c, and cpu_gemm_amx.c on the same
panels where the CPU has AMX-BF16, through cpu_gemm.py), each test once per GEMM, on CPUs
with AVX512-BF16 (skipped elsewhere; the AMX one only with AMX): the panel packing of
feature pairs, exact products where the float32 sums are exact, agreement with F.linear
(oneDNN: float32 sums, one rounding to bfloat16) on the model's shapes and ragged ones,
bitwise batch invariance, the bias added before the rounding, strided inputs, zero rows and
features, and refusals of mismatched sizes."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from executor.models import cpu_gemm
from tests.support.kernels import load_fresh, run_fresh_process, small_ints


@pytest.fixture(params=["vdpbf16ps", "amx"])
def kernel(request, kernel_cache, monkeypatch, one_thread):
    """``load_bf16()``'s kernel with its ``packed_gemm`` the ``vdpbf16ps`` one
    (``MESHSERVE_CPU_GEMM_AMX=0``) or the AMX one (skipped without AMX)."""
    monkeypatch.setenv(cpu_gemm.AMX_SWITCH, "1" if request.param == "amx" else "0")
    loaded = load_fresh(cpu_gemm, kernel_cache, monkeypatch, "no C compiler, or no AVX512-BF16 on this host",
                        loader="load_bf16")
    if loaded.amx != (request.param == "amx"):
        pytest.skip("no AMX-BF16 on this host (or Linux gave this process no tiles)")
    return loaded


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()



def test_panels_hold_feature_pairs_of_the_weight_columns_and_zeros_past_the_last(kernel):
    w = _randn(50, 7, seed=0)
    packed = cpu_gemm.pack_panels_bf16(w, kernel)
    width = kernel.panel_width
    assert width == 48
    assert packed.shape == (2, 4, 96) and packed.dtype == torch.bfloat16 and packed.data_ptr() % 64 == 0
    padded = torch.zeros(96, 8, dtype=torch.bfloat16)  # 2 panels of columns, features to an even 8
    padded[:50, :7] = w
    for p in range(2):
        for pair in range(4):
            want = padded[p * width:(p + 1) * width, 2 * pair:2 * pair + 2].reshape(-1)  # column j: 2 features
            assert torch.equal(packed[p, pair], want)


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 576, 576), (8, 1536, 576), (9, 64, 48), (5, 7, 3),
                                   (33, 576, 3072), (37, 101, 50), (300, 1536, 200), (129, 2048, 25)])
def test_products_are_exact_where_the_float32_sums_are(kernel, m, k, n):
    """Small integers: every pair product and float32 partial sum is exact, so the result
    is the integer product rounded once to bfloat16 (exact below 256 in magnitude),
    whatever the tile, panel, odd feature count and row-block edges."""
    x, w = small_ints(m, k, seed=m, dtype=torch.bfloat16), small_ints(n, k, seed=n, dtype=torch.bfloat16)
    got = cpu_gemm.panel_linear_bf16(x, cpu_gemm.pack_panels_bf16(w, kernel), (n, k), None)
    want = (x.long() @ w.long().T).float().bfloat16()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_the_bias_is_added_in_float32_before_the_one_rounding(kernel):
    """A sum of 257 plus a bias of 0.5 is 257.5 in float32, which rounds to 258 in
    bfloat16; rounding the sum first (256) and adding the bias after (256.5 → 256) would
    not give it."""
    k = 2
    x = torch.tensor([[1.0, 1.0]]).bfloat16()
    w = torch.tensor([[256.0, 1.0], [256.0, 0.0]]).bfloat16()
    bias = torch.tensor([0.5, 0.5]).bfloat16()
    got = cpu_gemm.panel_linear_bf16(x, cpu_gemm.pack_panels_bf16(w, kernel), (2, k), bias)
    assert got.float().tolist() == [[258.0, 256.0]]


@pytest.mark.parametrize("m", [1, 2, 7, 32, 150])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (320, 576)])
def test_agrees_with_f_linear_on_the_models_shapes(kernel, m, n, k):
    """SmolLM2-135M's qkv, o, gate_up and down, and a tensor-parallel shard of 320 columns:
    both sum in float32 (in different orders) and round once, so they differ by at most
    one bfloat16 step of the output plus the float32 sums' difference."""
    x, w = _randn(m, k, seed=1), (_randn(n, k, seed=2).float() * k ** -0.5).bfloat16()
    got = cpu_gemm.panel_linear_bf16(x, cpu_gemm.pack_panels_bf16(w, kernel), (n, k), None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("m", [1, 5, 32])
def test_agrees_with_f_linear_on_the_lm_head(kernel, m):
    x, w = _randn(m, 576, seed=1), (_randn(49152, 576, seed=2).float() * 576 ** -0.5).bfloat16()
    got = cpu_gemm.panel_linear_bf16(x, cpu_gemm.pack_panels_bf16(w, kernel), (49152, 576), None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=8e-3, atol=1e-3)


def test_a_row_is_computed_the_same_alone_and_in_any_batch(kernel):
    """Batch invariance: each output is one chain of pair dot products over the features,
    so a row's bits do not depend on its neighbours, its place in an 8-row tile, the
    row kernel a partial tile takes, or its row block (1536 features: 64 rows a block)."""
    k, n = 1536, 600
    w = (_randn(n, k, seed=3).float() * k ** -0.5).bfloat16()
    packed = cpu_gemm.pack_panels_bf16(w, kernel)
    x = _randn(300, k, seed=4)
    batch = cpu_gemm.panel_linear_bf16(x, packed, (n, k), None)
    for i in (0, 3, 7, 8, 63, 64, 65, 150, 299):
        assert torch.equal(cpu_gemm.panel_linear_bf16(x[i:i + 1], packed, (n, k), None)[0], batch[i])
    for rows in (slice(5, 40), slice(1, 4), slice(0, 257)):
        assert torch.equal(cpu_gemm.panel_linear_bf16(x[rows], packed, (n, k), None), batch[rows])


@pytest.mark.parametrize("k", [576, 70])
def test_an_output_gets_the_same_bits_whichever_rows_and_panels_share_its_pass(kernel, k):
    """The AMX GEMM multiplies two row tiles (32 rows) by a pair of panels (96 columns) in one
    pass, a lone last tile or panel alone, and writes a row's 96 outputs with 64-byte stores;
    the vdpbf16ps one has its own row blocks. Each output's bits are the same in any such
    grouping: every row alone, and in batches of 16, 32, 47 and 81 rows (pairs, lone tiles,
    padded tails); the first 48, 96 and 100 columns of the weight packed alone (one panel, a
    pair, a pair and a ragged one), against all 244 (two pairs and a ragged lone panel), with
    a bias; 70 features leave 3 pairs past the last block of 16 for the vector tail."""
    n = 244
    w, bias = (_randn(n, k, seed=20).float() * k ** -0.5).bfloat16(), _randn(n, seed=21)
    x = _randn(81, k, seed=22)
    full = cpu_gemm.panel_linear_bf16(x, cpu_gemm.pack_panels_bf16(w, kernel), (n, k), bias)
    for rows in (16, 32, 47, 81):
        part = cpu_gemm.panel_linear_bf16(x[:rows], cpu_gemm.pack_panels_bf16(w, kernel), (n, k), bias)
        assert torch.equal(part, full[:rows])
    for i in (0, 15, 16, 31, 32, 46, 47, 80):
        alone = cpu_gemm.panel_linear_bf16(x[i:i + 1], cpu_gemm.pack_panels_bf16(w, kernel), (n, k), bias)
        assert torch.equal(alone[0], full[i])
    for cols in (48, 96, 100):
        packed = cpu_gemm.pack_panels_bf16(w[:cols].contiguous(), kernel)
        assert torch.equal(cpu_gemm.panel_linear_bf16(x, packed, (cols, k), bias[:cols].contiguous()), full[:, :cols])
    torch.testing.assert_close(full, F.linear(x, w, bias), rtol=8e-3, atol=2e-2)


def test_linear_packs_bfloat16_into_panels_adds_the_bias_and_takes_strided_inputs(kernel):
    w, b = _randn(100, 64, seed=5), _randn(100, seed=6)
    packed = cpu_gemm.pack(w)
    assert cpu_gemm.is_panel_packed(packed) and packed.dtype == torch.bfloat16
    wide = _randn(9, 128, seed=7)
    x = wide[:, ::2]  # rows of 64 with a stride of 2 between features
    torch.testing.assert_close(cpu_gemm.linear(x, w, b, packed), F.linear(x, w, b), rtol=8e-3, atol=1e-2)
    rows = wide[:, :64]  # contiguous features, rows 128 apart
    assert torch.equal(cpu_gemm.linear(rows, w, b, packed), cpu_gemm.linear(rows.contiguous(), w, b, packed))
    assert cpu_gemm.linear(_randn(2, 3, 64, seed=8), w, None, packed).shape == (2, 3, 100)
    assert cpu_gemm.linear(torch.empty(0, 64, dtype=torch.bfloat16), w, None, packed).shape == (0, 100)
    x32 = _randn(4, 64, seed=9).float()  # another dtype than the panels: F.linear, as torch would
    with pytest.raises(RuntimeError):
        F.linear(x32, w)
    with pytest.raises(RuntimeError):
        cpu_gemm.linear(x32, w, None, packed)


@pytest.mark.parametrize("features", [63, 65, 128])
def test_a_feature_count_that_does_not_match_the_packed_weight_is_refused(kernel, features):
    """The C kernel trusts its sizes: the wrapper refuses a mismatch with a RuntimeError,
    as F.linear does, and a bias or panels of another weight too."""
    w = _randn(48, 64, seed=13)
    packed = cpu_gemm.pack(w)
    with pytest.raises(RuntimeError, match="bfloat16 CPU input"):
        cpu_gemm.linear(_randn(3, features, seed=14), w, None, packed)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_gemm.linear(_randn(3, 64, seed=14), w, _randn(47, seed=15), packed)
    with pytest.raises(RuntimeError, match="not the bfloat16 panels"):
        cpu_gemm.panel_linear_bf16(_randn(3, 64, seed=14), packed, (97, 64), None)  # more columns than it holds


def test_the_environment_switch_turns_the_kernel_off(kernel_cache, monkeypatch):
    monkeypatch.setenv("MESHSERVE_CPU_GEMM_KERNEL", "0")
    monkeypatch.setattr(cpu_gemm, "_loaded", {})
    assert cpu_gemm.load_bf16() is None


def test_the_c_function_takes_zero_rows_and_zero_features_without_dividing_by_zero(kernel, kernel_cache):
    """``packed_gemm_bf16`` itself (as ``packed_gemm``, the float32 one, does) with m = 0:
    nothing written; with k = 0: each output is its bias. It divided by the rows' block
    count and by the feature pairs, 0 here: SIGFPE, the whole process gone. Run in a child
    process so that a crash fails this test only."""
    script = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from executor.models import cpu_gemm\n"
        f"import os; os.environ['{cpu_gemm.AMX_SWITCH}'] = '{'1' if kernel.amx else '0'}'\n"
        "k = cpu_gemm.load_bf16()\n"
        f"assert k.amx == {kernel.amx}\n"
        "x, bias = torch.ones(2, 4, dtype=torch.bfloat16), torch.arange(5.0).bfloat16()\n"
        "packed = cpu_gemm.pack_panels_bf16(torch.ones(5, 4, dtype=torch.bfloat16), k)\n"
        "y = torch.full((2, 5), 7.0, dtype=torch.bfloat16)\n"
        "rc = k.packed_gemm(x.data_ptr(), 0, 4, 4, packed.data_ptr(), 5, bias.data_ptr(), y.data_ptr(), 5)\n"
        "print(rc, y.float().tolist())\n"
        "empty = cpu_gemm.pack_panels_bf16(torch.ones(5, 0, dtype=torch.bfloat16), k)\n"
        "rc = k.packed_gemm(x.data_ptr(), 2, 0, 4, empty.data_ptr(), 5, bias.data_ptr(), y.data_ptr(), 5)\n"
        "print(rc, y.float().tolist())\n")
    zero_rows, zero_features = run_fresh_process(script, kernel_cache).strip().splitlines()[-2:]
    assert zero_rows == "0 " + str([[7.0] * 5] * 2)
    assert zero_features == "0 " + str([[0.0, 1.0, 2.0, 3.0, 4.0]] * 2)


def test_the_amx_switch_keeps_the_vdpbf16ps_kernel_and_both_agree(kernel_cache, monkeypatch, one_thread):
    """On an AMX CPU ``load_bf16`` multiplies the panels on AMX tiles unless
    ``MESHSERVE_CPU_GEMM_AMX=0``; the two GEMMs agree within bfloat16's rounding of float32
    sums, maybe added in another order (skipped without AMX)."""
    kernels = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(cpu_gemm.AMX_SWITCH, switch)
        kernels[switch] = load_fresh(cpu_gemm, kernel_cache, monkeypatch, "no AVX512-BF16 here", loader="load_bf16")
    if not kernels["1"].amx:
        pytest.skip("no AMX-BF16 on this host (or Linux gave this process no tiles)")
    assert not kernels["0"].amx
    w, x, bias = _randn(200, 576, seed=1), _randn(40, 576, seed=2), _randn(200, seed=3)
    packed = cpu_gemm.pack_panels_bf16(w, kernels["0"])
    y = {}
    for switch, k in kernels.items():
        out = torch.empty(40, 200, dtype=torch.bfloat16)
        assert k.packed_gemm(x.data_ptr(), 40, 576, 576, packed.data_ptr(), 200, bias.data_ptr(), out.data_ptr(),
                             200) == 0
        y[switch] = out
    addresses = {ctypes.cast(k.packed_gemm, ctypes.c_void_p).value for k in kernels.values()}
    assert len(addresses) == 2  # two C functions
    torch.testing.assert_close(y["1"], y["0"], rtol=2e-2, atol=2e-2)
