"""The decoder layers in one C call (executor/models/cpu_decoder_stack.c): bitwise the eager
layers' hidden states, residual stream and KV cache writes, for every architecture the engine
serves, in float32 and bfloat16, on decode-only steps and on steps of short prefill chunks
(token rows); the engine's greedy tokens and logprobs the same with it off; the steps and
models it does not take left to the eager layers."""

from __future__ import annotations

import pytest
import torch

from executor.attention import cpu_kernel
from executor.models import cpu_decoder_stack, cpu_gemm
from executor.models.cpu_decoder_stack import DecoderStack
from meshserve.bench.ceiling import BLOCK_SIZE as BLOCK, step_inputs
from tests.support.tiny_models import KINDS, save_tiny



@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    paths = {}
    for kind in KINDS:
        paths[kind] = tmp_path_factory.mktemp(kind)
        save_tiny(kind, paths[kind])
    return paths


@pytest.fixture
def driver(one_thread):
    if cpu_decoder_stack.load() is None or cpu_kernel.load() is None:
        pytest.skip("no C compiler on this host")


def needs_gemm(dtype: str) -> None:
    """Skips where the dtype's GEMM kernel is missing (bfloat16 needs AVX512-BF16): the
    layers then run oneDNN or ``F.linear``, which the driver does not call."""
    if (cpu_gemm.load_bf16() if dtype == "bfloat16" else cpu_gemm.load()) is None:
        pytest.skip(f"no {dtype} GEMM kernel on this CPU")


def _forward(loaded, md, ids, positions, stack: DecoderStack | None):
    """Hidden states after the layers (before the final norm), the residual stream and the
    KV caches (copies of the bound ones, which stay as they were), through ``stack`` or,
    when None, the eager layers."""
    model = loaded.model
    bound = [layer.kv_cache for layer in model.attention_layers()]
    caches = [tuple(c.clone() for c in cache) for cache in bound]
    for layer, cache in zip(model.attention_layers(), caches):
        layer.kv_cache = cache
    md.plan = None
    model.attention_layers()[0].backend.plan(md)
    model.decoder_stack = None
    try:
        with torch.inference_mode():
            x, rope = model.embed(ids), model.rotary.lookup(positions)
            if stack is not None:
                assert stack.takes(x, rope, md)
                x, residual = stack.run(x, None, rope, md)
            else:
                x, residual = model.run_layers(x, None, positions, md)
    finally:
        for layer, cache in zip(model.attention_layers(), bound):
            layer.kv_cache = cache
    return x, residual, caches


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_driver_is_bitwise_the_eager_layers(tiny_models, driver, kind, dtype):
    """Decode-only (one token of each of 5 requests) and token rows (2 decodes beside
    prefill chunks of 7 and 20 tokens, one after cached context): the hidden states, the
    residual stream and every layer's KV cache equal bit for bit."""
    from executor.model_loader import load_model

    needs_gemm(dtype)
    loaded = load_model(tiny_models[kind], dtype=dtype, device="cpu")
    stack = DecoderStack.for_model(loaded.model.layers, loaded.dtype)
    assert stack is not None
    steps = {"decode": ([1] * 5, [40, 17, 2, 63, 9]), "token rows": ([1, 1, 7, 20], [30, 5, 0, 9])}
    for name, (query_lens, contexts) in steps.items():
        md, ids, positions = step_inputs(loaded, query_lens, contexts, seed=len(name), spare_blocks=3)
        got = _forward(loaded, md, ids, positions, stack)
        want = _forward(loaded, md, ids, positions, None)
        assert got[0].dtype == loaded.dtype and got[0].shape == (len(ids), loaded.hf_config.hidden_size)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        for (k_got, v_got), (k_want, v_want) in zip(got[2], want[2]):
            assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want), name
        assert not torch.equal(got[2][0][0], loaded.model.attention_layers()[0].kv_cache[0])  # the step wrote


def test_steps_with_other_attention_work_and_other_settings_stay_eager(tiny_models, driver, monkeypatch):
    """A long chunk (SDPA, or the prefill kernel: no decode-kernel rows), a step not yet
    planned, several threads: ``takes`` says no. float16, unpacked weights (after
    ``load_weights``) and ``MESHSERVE_CPU_DECODER_STACK=0``: no driver at all."""
    from executor.attention.torch_plan import PREFILL_KERNEL_MAX_LEN
    from executor.model_loader import load_model

    needs_gemm("float32")
    loaded = load_model(tiny_models["llama-bias"], dtype="float32", device="cpu")
    model = loaded.model
    stack = DecoderStack.for_model(model.layers, torch.float32)
    md, ids, positions = step_inputs(loaded, [1, 1, 3], [10, 20, 0], seed=1, spare_blocks=3)
    x, rope = model.embed(ids), model.rotary.lookup(positions)
    assert not stack.takes(x, rope, md)  # not planned
    model.attention_layers()[0].backend.plan(md)
    assert stack.takes(x, rope, md)
    assert not stack.takes(x.to(torch.bfloat16), rope, md)  # not the model's dtype
    down = model.layers[1].mlp.down_proj
    panels, down.packed_weight = down.packed_weight, None  # F.linear in this layer now
    assert not stack.takes(x, rope, md)
    down.packed_weight = panels
    assert stack.takes(x, rope, md)
    torch.set_num_threads(2)
    try:
        assert not stack.takes(x, rope, md)
    finally:
        torch.set_num_threads(1)
    long = PREFILL_KERNEL_MAX_LEN - 8
    md, ids, positions = step_inputs(loaded, [1, 3, 20], [10, 0, long], seed=2, spare_blocks=3)
    model.attention_layers()[0].backend.plan(md)
    assert md.plan.split is not None or md.plan.prefill_rows is not None  # SDPA or the prefill kernel takes it
    assert not stack.takes(model.embed(ids), model.rotary.lookup(positions % 256), md)  # (the model's 256 positions)

    assert DecoderStack.for_model(model.layers, torch.float16) is None
    norm = model.layers[0].post_attention_layernorm
    norm.weight.data = norm.weight.data.double()
    assert DecoderStack.for_model(model.layers, torch.float32) is None  # the eager norm keeps the torch ops there
    norm.weight.data = norm.weight.data.float()
    monkeypatch.setenv(cpu_decoder_stack.SWITCH, "0")
    assert DecoderStack.for_model(model.layers, torch.float32) is None
    monkeypatch.delenv(cpu_decoder_stack.SWITCH)
    model.load_weights([])  # drops the packed panels the driver's pointers name
    assert model.decoder_stack is None and DecoderStack.for_model(model.layers, torch.float32) is None
    model.process_weights_after_loading()
    assert DecoderStack.for_model(model.layers, torch.float32) is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_gives_the_same_tokens_and_logprobs_with_the_driver_off(tiny_models, driver, monkeypatch, dtype):
    """Greedy generation with top-3 logprobs through the engine (prefills as token rows,
    then decodes; 5 prompts over a 2-sequence batch, so requests join and leave): equal with
    ``MESHSERVE_CPU_DECODER_STACK=0``, and the driver ran the steps it takes."""
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from meshserve.sampling import SamplingParams

    needs_gemm(dtype)
    runs = []
    original = DecoderStack.run

    def counted(self, *args):
        runs[-1] += 1
        return original(self, *args)

    monkeypatch.setattr(DecoderStack, "run", counted)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 9, 17, 40, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    got = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_decoder_stack.SWITCH, switch)
        runs.append(0)
        engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen2"]), dtype=dtype, num_threads=1,
                                        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                                        batch=BatchSchedulerConfig(max_num_seqs=2, max_num_batched_tokens=48)))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(
                    (e.token_id, e.logprob, tuple(e.top_token_ids), tuple(e.top_logprobs)) for e in out.logprobs)
        assert engine.stats().num_free_blocks == 64
        got[switch] = outputs
    assert runs[0] > 12 and runs[1] == 0
    assert [len(got["1"][str(i)]) for i in range(5)] == [12] * 5
    assert got["1"] == got["0"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("how", ["data", "assign"])
def test_norm_weights_and_biases_given_new_memory_are_read_there(tiny_models, driver, dtype, how):
    """The layers' norm weights and biases moved to new memory after the driver named them,
    the KV caches left bound (as in serving): ``param.data = ...`` (what ``nn.Module._apply``
    does, e.g. ``share_memory()``) or ``load_state_dict(..., assign=True)``. The driver reads
    the new tensors, bitwise the eager layers, not the memory it named before (here kept
    alive and overwritten; once freed, a use after free). A norm weight of another dtype
    (the eager norm then runs torch's ops): the eager layers."""
    from executor.model_loader import load_model

    loaded = load_model(tiny_models["llama-bias"], dtype=dtype, device="cpu")
    model = loaded.model
    backend = model.attention_layers()[0].backend
    stack = DecoderStack.for_model(model.layers, loaded.dtype)
    md, ids, positions = step_inputs(loaded, [1, 1, 7, 20], [30, 5, 0, 9], seed=3, spare_blocks=3)  # caches bound once

    def layers(driver: DecoderStack | None):
        model.decoder_stack = driver
        md.plan = None
        backend.plan(md)
        with torch.inference_mode():
            x, rope = model.embed(ids), model.rotary.lookup(positions)
            takes = driver is not None and driver.takes(x, rope, md)
            return takes, model.run_layers(x, None, positions, md)

    takes, got = layers(stack)
    assert takes and torch.equal(got[0], layers(None)[1][0])  # the driver's table names these tensors now
    named = [p for layer in model.layers for p in (
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.self_attn.qkv_proj.bias,
        layer.self_attn.o_proj.bias, layer.mlp.gate_up_proj.bias, layer.mlp.down_proj.bias)]
    old = [p.detach() for p in named]  # their memory, held
    if how == "data":
        for p in named:
            p.data = p.data.clone()
    else:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    for t in old:
        t.fill_(float("nan"))
    takes, got = layers(stack)
    want = layers(None)[1]
    assert takes
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    norm = model.layers[1].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().to(torch.float64), requires_grad=False)
    assert not layers(stack)[0]


@pytest.mark.parametrize("slot", ["past the end", "negative"])
def test_a_slot_outside_the_caches_is_left_to_the_eager_layers_which_raise(tiny_models, driver, slot):
    """A slot mapping outside the bound caches (a metadata bug): the eager layers raise
    ``index_copy_``'s IndexError before writing anything; the driver, which copies the rows
    itself, would write outside the caches' memory, so it does not take the step."""
    from executor.model_loader import load_model

    loaded = load_model(tiny_models["qwen2"], dtype="float32", device="cpu")
    model = loaded.model
    md, ids, positions = step_inputs(loaded, [1, 1, 3], [10, 20, 0], seed=5, spare_blocks=3)
    key_cache = model.attention_layers()[0].kv_cache[0]
    md.slot_mapping[1] = key_cache.shape[0] * key_cache.shape[1] + 3 if slot == "past the end" else -1
    model.attention_layers()[0].backend.plan(md)
    stack = DecoderStack.for_model(model.layers, loaded.dtype)
    x, rope = model.embed(ids), model.rotary.lookup(positions)
    assert not stack.takes(x, rope, md)
    model.decoder_stack = stack
    with pytest.raises(IndexError), torch.inference_mode():
        model.run_layers(x, None, positions, md)
