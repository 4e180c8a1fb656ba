"""The fused CPU kernels (executor/models/cpu_fused.c: residual add + RMSNorm, rotary,
SiLU-and-multiply) against the torch ops they replace, in float32 and in bfloat16: the norm bitwise
(wherever the kernels found torch's sum order at load: ``norm_bitwise``) and the rotary
bitwise, SiLU within its exponential's last bit (float32) or one bfloat16 ulp (measured: none), row
by row independent of the batch; a bfloat16 model's logits and greedy tokens the same with the
kernels off; the torch ops kept where no compiler works."""

from __future__ import annotations

import pytest
import torch

from executor.models import cpu_fused, cpu_gemm
from executor.models.norm import RMSNorm
from executor.models.rotary import RotaryEmbedding
from tests.support.kernels import load_fresh, run_fresh_process

def _assert_norm_matches(got: torch.Tensor, want: torch.Tensor, bitwise: bool) -> None:
    """Bitwise where the kernels found torch's float32 sum order at load (``bitwise``:
    their ``norm_bitwise``; 8 lanes on AVX2 and AVX-512 hosts with torch 2.13); else
    float32 within a few ulps of the statistic, bfloat16 within two ulps (one before the
    weight, one after)."""
    if bitwise:
        assert torch.equal(got, want)
    elif got.dtype == torch.bfloat16:
        assert int(_ulps(got, want).max()) <= 2
    else:
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)


@pytest.fixture
def kernels(kernel_cache, monkeypatch, one_thread):
    return load_fresh(cpu_fused, kernel_cache, monkeypatch, "no C compiler on this host")


def _torch_ops(monkeypatch):
    """Makes the layers take their torch path for the rest of the test."""
    monkeypatch.setattr(cpu_fused, "_loaded", {"k": None})


def _norm(hidden: int = 576, seed: int = 0, dtype: torch.dtype = torch.float32) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return norm


def _rotary(dtype: torch.dtype = torch.float32) -> RotaryEmbedding:
    return RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 4096, dtype=dtype)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in bfloat16 ulps (steps between representable values), elementwise."""
    def ordered(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)  # sign-magnitude -> a monotonic integer
    return (ordered(got) - ordered(want)).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_is_bitwise_the_torch_rotary_on_the_qk_heads_of_a_fused_qkv(kernels, monkeypatch, dtype):
    """bfloat16: the table in bfloat16 as the model keeps it, each product and each sum
    rounded to bfloat16 as the torch ops round them."""
    g = torch.Generator().manual_seed(1)
    n, q_heads, kv_heads = 7, 9, 3
    qkv = (torch.randn(n, (q_heads + 2 * kv_heads) * 64, generator=g) * 3).to(dtype)
    positions = torch.tensor([0, 1, 5, 100, 2047, 3000, 4095])
    rotary = _rotary(dtype)
    cos, sin = rotary.lookup(positions)
    got = qkv.clone()
    rotary.rotate_(got.view(n, -1, 64)[:, : q_heads + kv_heads], cos, sin)
    _torch_ops(monkeypatch)
    want = qkv.clone()
    rotary.rotate_(want.view(n, -1, 64)[:, : q_heads + kv_heads], cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(got[:, (q_heads + kv_heads) * 64:], qkv[:, (q_heads + kv_heads) * 64:])  # v untouched
    assert not torch.equal(got[1:], qkv[1:])  # it did rotate (position 0 is the identity)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 100, 7])  # 7: shorter than a vector, torch's scalar sum
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_norm_kernel_is_bitwise_the_torch_norm_with_its_residual_add(kernels, monkeypatch, dtype, hidden, scale):
    """The residual add (rounded to bfloat16 in bfloat16), the float32 statistic summed in
    torch's order, the output rounded before and after the weight: bitwise, every row."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(64, hidden, generator=g) * scale).to(dtype)
    residual = (torch.randn(64, hidden, generator=g) * 4 * scale).to(dtype)
    norm = _norm(hidden, dtype=dtype)
    res_got = residual.clone()
    got, res_out = norm(x, res_got)
    assert res_out is res_got and got.dtype == dtype
    _torch_ops(monkeypatch)
    res_want = residual.clone()
    want, _ = norm(x, res_want)
    assert torch.equal(res_got, res_want)
    _assert_norm_matches(got, want, kernels.norm_bitwise)


def test_the_norm_finds_torchs_sum_order_on_this_host(kernels):
    """torch 2.13 sums float32 in vectors of 8 on AVX2 and on AVX-512 CPUs alike (its
    reductions dispatch to AVX2 code there): a 16-float order, which an AVX-512 host once
    got from the CPU's capability, leaves most rows a unit in the last place off."""
    import dataclasses
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("torch's float32 sum order is known for x86 only")
    assert kernels.norm_bitwise and kernels.lanes == 8
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(4)) * 3
    norm = _norm(576, dtype=torch.float32)
    want = norm._norm(x)
    assert torch.equal(cpu_fused.add_rms_norm(kernels, None, x.clone(), norm.weight, norm.eps), want)
    other = dataclasses.replace(kernels, lanes=24 - kernels.lanes)
    assert not torch.equal(cpu_fused.add_rms_norm(other, None, x.clone(), norm.weight, norm.eps), want)


def test_the_sum_order_probe_is_float32_on_the_cpu_whatever_torchs_defaults(kernel_cache):
    """The probe at load makes its own rows: float32 CPU tensors whatever default dtype or
    device the loading process set (``torch.set_default_dtype``/``set_default_device``). Rows
    of the default dtype were overrun by the float32 kernel in bfloat16 (heap corruption),
    misread in float64 (no order found), and on the meta device handed it a null pointer."""
    import ast

    script = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from executor.models import cpu_fused\n"
        "found = []\n"
        "for dtype, device in ((torch.float32, 'cpu'), (torch.float64, 'cpu'), (torch.bfloat16, 'cpu'),\n"
        "                      (torch.float32, 'meta')):\n"
        "    torch.set_default_dtype(dtype)\n"
        "    torch.set_default_device(device)\n"
        "    cpu_fused._loaded.clear()\n"
        "    k = cpu_fused.load()\n"
        "    torch.set_default_dtype(torch.float32)\n"
        "    torch.set_default_device('cpu')\n"
        "    found.append(None if k is None else (k.lanes, k.norm_bitwise))\n"
        "print(repr(found))\n")
    found = ast.literal_eval(run_fresh_process(script, kernel_cache).strip().splitlines()[-1])
    if found[0] is None:
        pytest.skip("no C compiler on this host")
    assert found == [found[0]] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernel_without_residual_leaves_its_input_alone(kernels, monkeypatch, dtype):
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    before = x.clone()
    norm = _norm(dtype=dtype)
    got = norm(x)
    assert torch.equal(x, before)
    _torch_ops(monkeypatch)
    _assert_norm_matches(got, norm(x), kernels.norm_bitwise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_whatever_the_batch(kernels, dtype):
    g = torch.Generator().manual_seed(4)
    x, residual = torch.randn(33, 576, generator=g).to(dtype), torch.randn(33, 576, generator=g).to(dtype)
    norm = _norm(dtype=dtype)
    whole, _ = norm(x, residual.clone())
    alone, _ = norm(x[17:18].clone(), residual[17:18].clone())
    assert torch.equal(whole[17:18], alone)
    gate_up = torch.randn(33, 2 * 64, generator=g).to(dtype)
    assert torch.equal(cpu_fused.silu_mul(kernels, gate_up)[17:18], cpu_fused.silu_mul(kernels, gate_up[17:18].clone()))


def test_float16_and_several_threads_keep_the_torch_ops(kernels):
    assert cpu_fused.usable(torch.zeros(2, 4, dtype=torch.float16)) is None
    assert cpu_fused.usable(torch.zeros(2, 4)) is kernels
    assert cpu_fused.usable(torch.zeros(2, 4, dtype=torch.bfloat16)) is kernels
    torch.set_num_threads(2)
    assert cpu_fused.usable(torch.zeros(2, 4)) is None
    assert cpu_fused.usable(torch.zeros(2, 4, dtype=torch.bfloat16)) is None


def test_a_bfloat16_norm_weight_on_float32_activations_keeps_the_torch_ops(kernels, monkeypatch):
    x = torch.randn(3, 64)
    norm = _norm(64, dtype=torch.bfloat16)
    got = norm(x)
    _torch_ops(monkeypatch)
    assert torch.equal(got, norm(x)) and got.dtype == torch.float32


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


def test_the_built_kernels_are_cached_on_disk(kernel_cache, monkeypatch, kernels):
    [built] = (kernel_cache / "kernels").glob("cpu_fused-*.so")
    monkeypatch.setattr(cpu_fused, "_loaded", {})
    monkeypatch.setattr(cpu_fused.cpu_kernel, "build", lambda *a: pytest.fail("rebuilt cached kernels"))
    assert cpu_fused.load() is not None
    assert list((kernel_cache / "kernels").glob("cpu_fused-*.so")) == [built]


def test_silu_mul_kernel_is_the_torch_swiglu_within_float32_rounding(kernels):
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(6, 2 * 1536, generator=g) * 4
    gate_up[0, :4] = torch.tensor([-100.0, -87.0, 0.0, 90.0])  # the exponential's clamps, both sides
    got = cpu_fused.silu_mul(kernels, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    assert got[0, 2] == 0.0 and got[0, 3] == want[0, 3]
    assert got[0, 0] == 0.0 and want[0, 0] == 0.0  # e^100 overflows to infinity in both: -100 / inf


def test_bfloat16_silu_is_the_torch_silu_on_every_finite_gate_value(kernels):
    """SiLU rounded to bfloat16 over all 65,280 finite bfloat16 gates (up = 1, so the
    product is the SiLU itself): the kernel's exponential (Cephes, within 2 float32 ulp)
    is not torch's (Sleef's, within 1), so a rounding to bfloat16 may go the other way
    where the float32 SiLU lies within an ulp or two of a rounding boundary: at most one
    bfloat16 ulp, and rarely (measured with torch 2.13's AVX2 exponential: never)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = bits[torch.isfinite(bits.float())].reshape(1, -1)
    got = cpu_fused.silu_mul(kernels, torch.cat([gate, torch.ones_like(gate)], dim=-1))
    want = torch.nn.functional.silu(gate)
    ulps = _ulps(got, want)
    assert got.dtype == torch.bfloat16 and gate.numel() == 65280
    assert int(ulps.max()) <= 1
    assert int((ulps != 0).sum()) <= 6  # <= 0.01 %


def test_bfloat16_silu_mul_rounds_the_silu_then_its_product_with_up_as_torch(kernels):
    """``F.silu(gate).mul_(up)`` in bfloat16 rounds twice: the SiLU, then the product.
    The kernel's product of its own rounded SiLU with up is exactly torch's product of
    the same two bfloat16 values, and the whole within the SiLU bound above."""
    g = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(16, 2 * 1536, generator=g) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_fused.silu_mul(kernels, gate_up)
    silu = cpu_fused.silu_mul(kernels, torch.cat([gate, torch.ones_like(up)], dim=-1))
    assert torch.equal(got, silu * up)
    want = torch.nn.functional.silu(gate).mul_(up)
    assert int((_ulps(silu, torch.nn.functional.silu(gate)) > 1).sum()) == 0
    assert int((got != want).sum()) <= 3  # <= 0.01 %: a SiLU one ulp off moves its product <= 2 ulps
    assert int(_ulps(got, want).max()) <= 2


@pytest.mark.model
def test_a_bfloat16_model_computes_the_same_logits_and_greedy_tokens_with_the_kernels_off(
        small_model, kernel_cache, monkeypatch, one_thread):
    """S in bfloat16 on one thread: one decode step's logits bitwise, and the greedy tokens
    of a few prompts, the same with ``MESHSERVE_CPU_FUSED_KERNELS=0`` (the torch ops). The
    eager layers on both sides (``MESHSERVE_CPU_DECODER_STACK=0``: the driver, which calls
    the kernels from C, has its own tests)."""
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from executor.model_loader import load_model
    from meshserve.bench.ceiling import decode_step_inputs
    from meshserve.sampling import SamplingParams

    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(kernel_cache))
    monkeypatch.setenv("MESHSERVE_CPU_DECODER_STACK", "0")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    loaded = load_model(small_model, dtype="bfloat16", device="cpu")
    md, input_ids, positions = decode_step_inputs(loaded, 8, 40)
    backend = loaded.model.attention_layers()[0].backend
    calls = {name: 0 for name in ("add_rms_norm", "rotate_", "silu_mul")}
    for name in calls:  # count the kernel calls: the layers did take them, in bfloat16
        def counted(k, first, *rest, _name=name, _kernel=getattr(cpu_fused, name)):
            assert first is None or first.dtype == torch.bfloat16
            calls[_name] += 1
            return _kernel(k, first, *rest)
        monkeypatch.setattr(cpu_fused, name, counted)
    logits, tokens = {}, {}
    for side in ("1", "0"):
        monkeypatch.setenv("MESHSERVE_CPU_FUSED_KERNELS", side)
        monkeypatch.setattr(cpu_fused, "_loaded", {})
        assert (cpu_fused.load() is None) == (side == "0")
        if side == "1":
            bitwise = cpu_fused.load().norm_bitwise
        md.plan = None
        backend.plan(md)
        with torch.inference_mode():
            logits[side] = loaded.model.compute_logits(loaded.model(input_ids, positions, md))
        engine = LLMEngine(EngineConfig(model=str(small_model), dtype="bfloat16", num_threads=1,
                                        cache=CacheConfig(num_blocks=32),
                                        batch=BatchSchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64)))
        tokens[side] = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert engine.stats().num_free_blocks == 32
    layers = len(loaded.model.layers)  # per forward: one rotary and one SiLU a layer, two norms and the final one
    # (where the AMX GEMM applies the SiLU as it writes, the layers never call silu_mul: its own tests)
    fused_silu = loaded.model.layers[0].mlp.gate_up_proj.silu_packed is not None
    assert fused_silu == bool(cpu_gemm.load_bf16() is not None and cpu_gemm.load_bf16().amx)
    assert calls["rotate_"] > 0 and calls["silu_mul"] == (0 if fused_silu else calls["rotate_"])
    assert calls["add_rms_norm"] * layers == calls["rotate_"] * (2 * layers + 1)
    assert [len(t) for t in tokens["1"]] == [8, 8, 8]
    if bitwise:
        assert torch.equal(logits["1"], logits["0"])
        assert tokens["1"] == tokens["0"]
    else:  # the norm within its rounding (see _assert_norm_matches): logits within bfloat16 noise
        torch.testing.assert_close(logits["1"], logits["0"], rtol=0.0, atol=0.1)
