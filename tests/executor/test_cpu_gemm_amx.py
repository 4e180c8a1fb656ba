"""bfloat16 on a CPU with AMX, opted in (``MESHSERVE_CPU_GEMM_AMX=1``;
executor/models/cpu_gemm.py, ``pack_amx``): a layer keeps its panels for steps of fewer than
``AMX_MIN_ROWS`` tokens and multiplies larger steps through oneDNN's packing (its AMX
kernels); the one-call decoder stack takes only the small steps. Off by default.

Where the CPU has no AMX, ``cpu_has_amx_bf16`` is patched to say it has: oneDNN's bfloat16
packing then runs its AVX512-BF16 kernels, which is enough to check the routing; the tests
skip where neither our bfloat16 kernel nor oneDNN's bfloat16 packing exists (AVX2 hosts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.models import cpu_decoder_stack, cpu_gemm
from executor.models.cpu_decoder_stack import DecoderStack
from meshserve.bench.ceiling import step_inputs
from tests.support.tiny_models import save_tiny


@pytest.fixture
def amx(one_thread, monkeypatch):
    if cpu_gemm.load_bf16() is None:
        pytest.skip("no bfloat16 GEMM kernel on this CPU (AVX512-BF16)")
    monkeypatch.setattr(cpu_gemm, "cpu_has_amx_bf16", lambda: True)
    monkeypatch.setenv(cpu_gemm.AMX_SWITCH, "1")


def _weight(out_features=200, in_features=96):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    return weight, bias, torch.randn(40, in_features, generator=gen).bfloat16()


def test_small_steps_go_through_the_panels_and_large_ones_through_onednn(amx):
    weight, bias, x = _weight()
    packed = cpu_gemm.pack(weight)
    copy = cpu_gemm.pack_amx(weight, packed)
    assert cpu_gemm.is_panel_packed(packed) and copy is not None and copy.is_mkldnn
    assert cpu_gemm.AMX_MIN_ROWS == 16
    for rows in (1, 15):
        got = cpu_gemm.linear(x[:rows], weight, bias, packed, copy)
        assert torch.equal(got, cpu_gemm.panel_linear_bf16(x[:rows], packed, tuple(weight.shape), bias)), rows
    for rows in (16, 40):
        got = cpu_gemm.linear(x[:rows], weight, bias, packed, copy)
        assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x[:rows], copy, bias, "none", [], "")), rows
        torch.testing.assert_close(got.float(), F.linear(x[:rows], weight, bias).float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(cpu_gemm.linear(x, weight, bias, packed), cpu_gemm.panel_linear_bf16(
        x, packed, tuple(weight.shape), bias))  # without the copy: the panels at every size


def test_the_copy_is_made_only_beside_bfloat16_panels_on_an_amx_cpu(amx, monkeypatch):
    weight, _, _ = _weight()
    packed = cpu_gemm.pack(weight)
    assert cpu_gemm.pack_amx(weight, None) is None  # no panels: F.linear or oneDNN serve every step
    float_weight = weight.float()
    assert cpu_gemm.pack_amx(float_weight, cpu_gemm.pack(float_weight)) is None  # float32: no AMX
    monkeypatch.delenv(cpu_gemm.AMX_SWITCH)
    assert cpu_gemm.pack_amx(weight, packed) is None  # off by default: bfloat16 keeps its bits at every step size
    monkeypatch.setenv(cpu_gemm.AMX_SWITCH, "0")
    assert cpu_gemm.pack_amx(weight, packed) is None
    monkeypatch.setenv(cpu_gemm.AMX_SWITCH, "1")
    monkeypatch.setattr(cpu_gemm, "cpu_has_amx_bf16", lambda: False)
    assert cpu_gemm.pack_amx(weight, packed) is None


def test_the_decoder_stack_takes_only_steps_below_the_amx_rows(amx, tmp_path):
    """Every linear layer and the LM head of a loaded bfloat16 model get their copy; a decode
    step of 5 requests goes to the stack, one of 16 tokens (2 decodes beside a 14-token chunk)
    to the eager layers."""
    from executor.model_loader import load_model

    if cpu_decoder_stack.load() is None:
        pytest.skip("no C compiler on this host")
    save_tiny("llama-bias", tmp_path)
    loaded = load_model(tmp_path, dtype="bfloat16", device="cpu")
    linears = [m for m in loaded.model.modules() if hasattr(m, "packed_weight")]
    assert len(linears) == 4 * len(loaded.model.layers) + 1  # and the LM head
    assert all(m.packed_weight_amx is not None for m in linears)
    stack = DecoderStack.for_model(loaded.model.layers, loaded.dtype)
    assert stack is not None
    for query_lens, contexts, taken in (([1] * 5, [40, 17, 2, 63, 9], True), ([1, 1, 14], [30, 5, 9], False)):
        md, ids, positions = step_inputs(loaded, query_lens, contexts)
        loaded.model.attention_layers()[0].backend.plan(md)
        with torch.inference_mode():
            x, rope = loaded.model.embed(ids), loaded.model.rotary.lookup(positions)
            assert stack.takes(x, rope, md) is taken, query_lens
