"""The AMX GEMM that applies SwiGLU's activation as it writes (cpu_gemm_amx.c's
packed_gemm_silu_bf16_amx, through cpu_gemm_silu.pack_silu_mul and silu_mul_linear_bf16), on CPUs
with AMX-BF16 (skipped elsewhere): bitwise the GEMM then cpu_fused's silu_mul, the layer's
plain output from the same panels, the model's switch, and refusals of mismatched sizes."""

from __future__ import annotations

import pytest
import torch

from executor.models import cpu_fused, cpu_gemm, cpu_gemm_silu
from executor.models.linear import MergedColumnParallelLinear
from tests.support.kernels import load_fresh


@pytest.fixture
def kernels(kernel_cache, monkeypatch, one_thread):
    """The bfloat16 GEMM with its AMX kernels and the fused kernels (skipped without AMX)."""
    monkeypatch.setenv(cpu_gemm.AMX_SWITCH, "1")
    monkeypatch.delenv(cpu_gemm_silu.SILU_SWITCH, raising=False)
    gemm = load_fresh(cpu_gemm, kernel_cache, monkeypatch, "no C compiler, or no AVX512-BF16 on this host",
                      loader="load_bf16")
    if not gemm.amx or gemm.packed_gemm_silu is None:
        pytest.skip("no AMX-BF16 on this host (or Linux gave this process no tiles)")
    fused = load_fresh(cpu_fused, kernel_cache, monkeypatch, "no C compiler on this host")
    return gemm, fused


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# inter: the model's 1,536 (16 groups of 96), a group cut at 48 columns and below, one column;
# in: the model's 576, a tail of pairs past the last block of 32 features (70), odd (37), tiny (3)
@pytest.mark.parametrize("inter,k", [(1536, 576), (100, 70), (48, 37), (97, 576), (200, 3), (1, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_gemm_is_bitwise_the_gemm_then_silu_mul(kernels, inter, k, with_bias):
    """Every output's bits equal those of the [gate | up] GEMM on the weight's own panels
    followed by cpu_fused's silu_mul, for batches cut anywhere among the row tiles."""
    gemm, fused = kernels
    w = _randn(2 * inter, k, seed=inter)
    bias = _randn(2 * inter, seed=k) if with_bias else None
    packed, plain = cpu_gemm_silu.pack_silu_mul(w), cpu_gemm.pack_panels_bf16(w, gemm)
    assert packed.shape == (4 * -(-inter // 96), -(-k // 2), 96)
    for m in (1, 5, 17, 32, 33, 150, 457):
        x = _randn(m, k, seed=m)
        want = cpu_fused.silu_mul(fused, cpu_gemm.panel_linear_bf16(x, plain, (2 * inter, k), bias))
        got = cpu_gemm_silu.silu_mul_linear_bf16(x, packed, (2 * inter, k), bias)
        assert got.shape == (m, inter)
        assert torch.equal(_bits(got), _bits(want)), m


def test_denormal_products_infinities_and_nans_round_as_silu_mul_rounds_them(kernels):
    """Rows scaled down until SiLU(gate) * up is a float32 denormal (VCVTNEPS2BF16 would flush
    it to zero; silu_mul keeps it), a weight with an infinity and a NaN, rows near overflow."""
    gemm, fused = kernels
    inter, k = 100, 64
    w = _randn(2 * inter, k, seed=1)
    w[3, 5], w[inter + 7, 2] = float("nan"), float("inf")
    x = _randn(40, k, seed=2) * torch.logspace(-25, -15, 40).view(40, 1).bfloat16()
    x[0] *= 1e30
    packed, plain = cpu_gemm_silu.pack_silu_mul(w), cpu_gemm.pack_panels_bf16(w, gemm)
    want = cpu_fused.silu_mul(fused, cpu_gemm.panel_linear_bf16(x, plain, (2 * inter, k), None))
    got = cpu_gemm_silu.silu_mul_linear_bf16(x, packed, (2 * inter, k), None)
    assert int(((want.float().abs() < 2 ** -126) & (want != 0)).sum()) > 100  # denormals made it out
    assert bool(want.isnan().any()) and bool(want.isinf().any())
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("inter", [1536, 100])
def test_a_layer_packed_for_the_fused_gemm_gives_its_plain_output_and_its_activation(kernels, inter):
    """MergedColumnParallelLinear(silu_mul=True): packed for the fused GEMM only; ``forward`` is
    bitwise the GEMM on the plain panels (columns put back in order, the bias too), and
    ``forward_silu_mul`` bitwise silu_mul of that."""
    gemm, fused = kernels
    layer = MergedColumnParallelLinear(64, [inter, inter], bias=True, dtype=torch.bfloat16, silu_mul=True)
    layer.weight.data.copy_(_randn(2 * inter, 64, seed=3))
    layer.bias.data.copy_(_randn(2 * inter, seed=4))
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.silu_packed is not None
    x = _randn(21, 64, seed=5)
    plain = cpu_gemm.panel_linear_bf16(x, cpu_gemm.pack_panels_bf16(layer.weight, gemm), (2 * inter, 64), layer.bias)
    assert torch.equal(_bits(layer(x)), _bits(plain))
    assert torch.equal(_bits(layer.forward_silu_mul(x)), _bits(cpu_fused.silu_mul(fused, plain)))


def test_the_switch_and_a_plain_merged_layer_keep_the_plain_panels(kernels, monkeypatch):
    inter = 96
    for switch, silu_mul, fused in (("0", True, False), ("1", False, False), ("1", True, True)):
        monkeypatch.setenv(cpu_gemm_silu.SILU_SWITCH, switch)
        layer = MergedColumnParallelLinear(64, [inter, inter], dtype=torch.bfloat16, silu_mul=silu_mul)
        layer.weight.data.copy_(_randn(2 * inter, 64, seed=6))
        layer.process_weights_after_loading()
        assert (layer.silu_packed is not None) == fused
        assert (layer.packed_weight is not None) == (not fused)
        assert (layer.forward_silu_mul(_randn(3, 64, seed=7)) is not None) == fused
    with pytest.raises(ValueError):
        MergedColumnParallelLinear(64, [96, 48], dtype=torch.bfloat16, silu_mul=True)


def test_sizes_that_do_not_match_the_packing_are_refused(kernels):
    w = _randn(200, 64, seed=8)
    packed = cpu_gemm_silu.pack_silu_mul(w)
    with pytest.raises(RuntimeError):  # another feature count
        cpu_gemm_silu.silu_mul_linear_bf16(_randn(3, 62, seed=9), packed, (200, 64), None)
    with pytest.raises(RuntimeError):  # the panels of another weight
        cpu_gemm_silu.silu_mul_linear_bf16(_randn(3, 64, seed=9), packed, (400, 64), None)
    with pytest.raises(RuntimeError):  # a bias of another size
        cpu_gemm_silu.silu_mul_linear_bf16(_randn(3, 64, seed=9), packed, (200, 64), _randn(100, seed=10))
    with pytest.raises(RuntimeError):  # float32 input
        cpu_gemm_silu.silu_mul_linear_bf16(torch.zeros(3, 64), packed, (200, 64), None)
    assert cpu_gemm_silu.pack_silu_mul(_randn(201, 64, seed=11)) is None  # no gate/up halves
    assert cpu_gemm_silu.pack_silu_mul(w.float()) is None
    assert cpu_gemm_silu.pack_silu_mul(_randn(200, 0, seed=12)) is None  # no features
    assert cpu_gemm_silu.pack_silu_mul(_randn(0, 64, seed=12)) is None  # no outputs
    x = _randn(3, 64, seed=9)  # the layer's plain output: its errors name the weight's own sizes
    with pytest.raises(RuntimeError, match=r"a \(200,\) bfloat16 CPU bias"):
        cpu_gemm_silu.silu_panels_linear_bf16(x, packed, (200, 64), _randn(100, seed=10))
    with pytest.raises(RuntimeError, match="fused SiLU packing of a 400 x 64 weight"):
        cpu_gemm_silu.silu_panels_linear_bf16(x, packed, (400, 64), None)
