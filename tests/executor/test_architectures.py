"""Architecture coverage: tiny random-init Llama, Qwen2 and Mistral models saved with
``save_pretrained``, loaded by our loader, checked against transformers' greedy
generate (the same near-tie rule as the golden test)."""

from __future__ import annotations

import pytest
import torch

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from meshserve.sampling import SamplingParams
from tests.support.reference import HFReference, assert_greedy_matches
from tests.support.tiny_models import KINDS, save_tiny, tiny_config

pytestmark = pytest.mark.model

@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_matches_transformers(kind, tmp_path):
    save_tiny(kind, tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 15, 17, 40, 70)]
    max_new = 20
    refs = HFReference(tmp_path).greedy_many(prompts, max_new)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32",  # "auto" may be bfloat16 on some CPUs
                                    cache=CacheConfig(block_size=16, num_blocks=64),
                                    batch=BatchSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)))
    if kind == "mistral-sliding-window":
        assert engine.max_model_len == 96  # capped at the window: attention is never windowed
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
    assert_greedy_matches(outputs, refs)
    assert engine.stats().num_free_blocks == 64


def test_bfloat16_runs(tmp_path):
    save_tiny("qwen2", tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="bfloat16", cache=CacheConfig(num_blocks=16)))
    assert engine.worker_group.worker.kv_caches[0][0].dtype == torch.bfloat16
    outputs = engine.generate([[5, 6, 7], [8] * 20], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in outputs] == [5, 5]


BF16_TIE_TOL = 0.05
"""bfloat16 goldens: a divergence from the bfloat16 reference is accepted only where its
top-2 logits are within this (bfloat16 keeps 8 significant bits: logits of a few units
round in steps of about 0.016, and our matmuls and attention round in other orders)."""


@pytest.mark.parametrize("kind", ["llama-tied-llama3-rope", "qwen2"])
def test_bfloat16_matches_the_bfloat16_reference_within_its_tolerance(kind, tmp_path):
    """The bfloat16 path against transformers in bfloat16: greedy tokens equal up to a
    near tie (``BF16_TIE_TOL``), at most one prompt of five diverging there."""
    save_tiny(kind, tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 16, 33, 50, 70)]
    refs = HFReference(tmp_path, dtype=torch.bfloat16).greedy_many(prompts, 16)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="bfloat16", cache=CacheConfig(num_blocks=64),
                                    batch=BatchSchedulerConfig(max_num_seqs=5, max_num_batched_tokens=64)))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert_greedy_matches(outputs, refs, tie_tol=BF16_TIE_TOL, max_divergent=1)
    assert engine.stats().num_free_blocks == 64


def test_norm_and_rotary_are_bitwise_the_reference():
    """The in-place RMSNorm (with the residual add folded in) and the half-table rotary
    round exactly as transformers' LlamaRMSNorm and apply_rotary_pos_emb."""
    from transformers.models.llama import modeling_llama as hf

    from executor.models.norm import RMSNorm
    from executor.models.rotary import RotaryEmbedding, rope_inv_freq

    config = tiny_config("llama-tied-llama3-rope")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, residual = (torch.randn(2, 7, 96, generator=gen) * 3).to(dtype)
        ours, theirs = RMSNorm(96, 1e-5, dtype), hf.LlamaRMSNorm(96, eps=1e-5).to(dtype)
        weight = torch.randn(96, generator=gen).to(dtype)
        ours.weight.data.copy_(weight)
        theirs.weight.data.copy_(weight)
        assert torch.equal(ours(x.clone()), theirs(x))
        normed, summed = ours(x.clone(), residual.clone())
        assert torch.equal(summed, residual + x) and torch.equal(normed, theirs(residual + x))

        positions = torch.randint(0, 256, (7,), generator=gen)
        q = torch.randn(7, 6, 16, generator=gen).to(dtype)
        k = torch.randn(7, 2, 16, generator=gen).to(dtype)
        cos, sin = hf.LlamaRotaryEmbedding(config)(q, positions[None])
        want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        inv_freq, scaling = rope_inv_freq(config)
        got_q, got_k = RotaryEmbedding(inv_freq, 256, scaling, dtype)(positions, q, k)
        assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_packed_cpu_gemm_matches_f_linear_and_is_batch_invariant():
    """cpu_gemm: the packed product is F.linear up to rounding, and a row's result does
    not depend on how many rows are in the batch (or falls back to F.linear)."""
    import torch.nn.functional as F

    from executor.models import cpu_gemm

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(70, 96, generator=gen)
    packed = cpu_gemm.pack(weight)
    if packed is None:
        pytest.skip("no oneDNN packing on this host: layers use F.linear")
    full = cpu_gemm.linear(x, weight, bias, packed)
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 3, 17, 32):
        assert torch.equal(cpu_gemm.linear(x[:rows], weight, bias, packed), full[:rows])
    assert cpu_gemm.pack(weight.to(torch.float16)) is None  # not a dtype it packs: F.linear
    assert cpu_gemm.linear(x, weight, None, None).equal(F.linear(x, weight))


def test_auto_dtype_on_cpu_is_float32_without_native_bf16_and_never_the_slower_with_it(monkeypatch):
    from types import SimpleNamespace

    from executor import model_loader
    from executor.models import cpu_dtype

    cpu, config = torch.device("cpu"), SimpleNamespace(hidden_size=64, intermediate_size=128)
    probes = []

    def probe(hidden, intermediate):
        probes.append((hidden, intermediate))
        return timings

    monkeypatch.setattr(cpu_dtype, "probe_matmul_ms", probe)
    monkeypatch.setattr(cpu_dtype, "cpu_has_native_bf16", lambda: False)
    cpu_dtype.choose_cpu_dtype.cache_clear()
    assert model_loader.resolve_dtype("auto", config, cpu) == torch.float32
    assert probes == []  # no native bfloat16: nothing measured
    monkeypatch.setattr(cpu_dtype, "cpu_has_native_bf16", lambda: True)
    for timings, expected in (((10.0, 6.0), torch.bfloat16), ((10.0, 9.0), torch.float32),
                              ((10.0, 14.0), torch.float32)):
        cpu_dtype.choose_cpu_dtype.cache_clear()
        assert model_loader.resolve_dtype("auto", config, cpu) == expected, timings
    assert probes == [(64, 128)] * 3
    cpu_dtype.choose_cpu_dtype.cache_clear()
    assert model_loader.resolve_dtype("float32", config, cpu) == torch.float32
    assert model_loader.resolve_dtype("bfloat16", config, cpu) == torch.bfloat16


def test_dtype_probe_measures_both_dtypes_on_this_cpu():
    from executor.models import cpu_dtype

    f32, bf16 = cpu_dtype.probe_matmul_ms(64, 128, repeat=1)
    assert f32 > 0 and bf16 > 0
