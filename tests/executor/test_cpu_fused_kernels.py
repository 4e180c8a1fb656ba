"""The fused CPU norm and rotary kernels (executor/models/cpu_fused.c) against the torch ops
they replace: rotary bitwise, the norm's residual bitwise and its output within float32
rounding, row by row independent of the batch, and the torch ops kept where no compiler works."""

from __future__ import annotations

import pytest
import torch

from executor.models import cpu_fused
from executor.models.norm import RMSNorm
from executor.models.rotary import RotaryEmbedding


@pytest.fixture
def kernels(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_fused, "_loaded", {})
    k = cpu_fused.load()
    if k is None:
        pytest.skip("no C compiler on this host")
    return k


def _torch_ops(monkeypatch):
    """Makes the layers take their torch path for the rest of the test."""
    monkeypatch.setattr(cpu_fused, "_loaded", {"k": None})


def _norm(hidden: int = 576, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return norm


def _rotary() -> RotaryEmbedding:
    return RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 4096)


def test_rotary_kernel_is_bitwise_the_torch_rotary_on_the_qk_heads_of_a_fused_qkv(kernels, monkeypatch):
    g = torch.Generator().manual_seed(1)
    n, q_heads, kv_heads = 7, 9, 3
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * 64, generator=g) * 3
    positions = torch.tensor([0, 1, 5, 100, 2047, 3000, 4095])
    rotary = _rotary()
    cos, sin = rotary.lookup(positions)
    got = qkv.clone()
    rotary.rotate_(got.view(n, -1, 64)[:, : q_heads + kv_heads], cos, sin)
    _torch_ops(monkeypatch)
    want = qkv.clone()
    rotary.rotate_(want.view(n, -1, 64)[:, : q_heads + kv_heads], cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(got[:, (q_heads + kv_heads) * 64:], qkv[:, (q_heads + kv_heads) * 64:])  # v untouched
    assert not torch.equal(got[1:], qkv[1:])  # it did rotate (position 0 is the identity)


def test_norm_kernel_adds_the_residual_bitwise_and_norms_within_float32_rounding(kernels, monkeypatch):
    g = torch.Generator().manual_seed(2)
    x, residual = torch.randn(9, 576, generator=g), torch.randn(9, 576, generator=g) * 4
    norm = _norm()
    res_got = residual.clone()
    got, res_out = norm(x, res_got)
    assert res_out is res_got
    _torch_ops(monkeypatch)
    res_want = residual.clone()
    want, _ = norm(x, res_want)
    assert torch.equal(res_got, res_want)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    exact = res_want.double() * torch.rsqrt(res_want.double().pow(2).mean(-1, keepdim=True) + 1e-5) \
        * norm.weight.double()
    assert float((got.double() - exact).abs().max()) <= float((want.double() - exact).abs().max()) * 2


def test_norm_kernel_without_residual_leaves_its_input_alone(kernels, monkeypatch):
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3))
    before = x.clone()
    norm = _norm()
    got = norm(x)
    assert torch.equal(x, before)
    _torch_ops(monkeypatch)
    torch.testing.assert_close(got, norm(x), rtol=2e-6, atol=1e-6)


def test_each_row_is_the_same_whatever_the_batch(kernels):
    g = torch.Generator().manual_seed(4)
    x, residual = torch.randn(33, 576, generator=g), torch.randn(33, 576, generator=g)
    norm = _norm()
    whole, _ = norm(x, residual.clone())
    alone, _ = norm(x[17:18].clone(), residual[17:18].clone())
    assert torch.equal(whole[17:18], alone)


def test_bfloat16_and_several_threads_keep_the_torch_ops(kernels):
    assert cpu_fused.usable(torch.zeros(2, 4, dtype=torch.bfloat16)) is None
    assert cpu_fused.usable(torch.zeros(2, 4)) is kernels
    torch.set_num_threads(2)
    assert cpu_fused.usable(torch.zeros(2, 4)) is None


def test_no_working_compiler_keeps_the_torch_ops(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_fused, "_loaded", {})
    assert cpu_fused.load() is None
    assert not list((tmp_path / "kernels").glob("cpu_fused-*.so"))
    x, residual = torch.randn(3, 576), torch.randn(3, 576)
    want_res = residual + x
    out, res = _norm()(x, residual)
    assert torch.equal(res, want_res) and out.shape == (3, 576)


def test_the_built_kernels_are_cached_on_disk(tmp_path, monkeypatch, kernels):
    [built] = (tmp_path / "kernels").glob("cpu_fused-*.so")
    monkeypatch.setattr(cpu_fused, "_loaded", {})
    monkeypatch.setattr(cpu_fused.cpu_kernel, "build", lambda *a: pytest.fail("rebuilt cached kernels"))
    assert cpu_fused.load() is not None
    assert list((tmp_path / "kernels").glob("cpu_fused-*.so")) == [built]


def test_silu_mul_kernel_is_the_torch_swiglu_within_float32_rounding(kernels):
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(6, 2 * 1536, generator=g) * 4
    gate_up[0, :4] = torch.tensor([-100.0, -87.0, 0.0, 90.0])  # the exponential's clamps, both sides
    got = cpu_fused.silu_mul(kernels, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    assert got[0, 2] == 0.0 and got[0, 3] == want[0, 3]
