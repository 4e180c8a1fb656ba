"""``--compile``: decode steps through ``torch.compile`` per batch-size bucket
(``executor.worker.compiled_decode``): the buckets, the padded attention op, greedy
tokens equal to the eager engine's, and the places where it stays eager."""

from __future__ import annotations

import logging

import pytest
import torch

from executor.attention import cpu_kernel
from executor.worker.compiled_decode import bucket_for, decode_buckets


def test_decode_buckets_are_powers_of_two_then_max_num_seqs():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 3)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        decode_buckets(0)


def test_a_batch_pads_to_the_smallest_bucket_that_holds_it():
    buckets = (1, 2, 4, 8, 16, 32, 48)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 33, 48)] == [1, 2, 4, 8, 8, 16, 32, 48, 48]
    assert bucket_for(49, buckets) is None  # above the largest bucket: eager
    assert bucket_for(0, buckets) is None


@pytest.mark.usefixtures("one_thread")
def test_padded_decode_attention_writes_and_attends_only_the_real_rows():
    fn = cpu_kernel.load()
    if fn is None:
        pytest.skip("no C compiler: the CPU attention kernel cannot be built here")
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim, rows, real = 12, 4, 2, 6, 16, 4, 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    k = torch.randn(rows, kv_heads, dim, generator=gen)
    v = torch.randn(rows, kv_heads, dim, generator=gen)
    block_table = torch.tensor([[3, 5, 0, 0], [7, 0, 0, 0], [1, 2, 9, 0], [4, 4, 4, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 2, 11, 16], dtype=torch.int32)  # row 3 is padding: never read
    slots = torch.tensor([5 * 4 + 1, 7 * 4 + 1, 9 * 4 + 2, 4 * 4 + 3])  # the last token of each request
    before_k, before_v = key_cache.clone(), value_cache.clone()

    out = cpu_kernel.padded_decode_attention(q, k, v, key_cache, value_cache, slots, block_table, seq_lens,
                                             torch.tensor(real), 0.25)

    want_k, want_v = before_k.view(-1, kv_heads, dim).clone(), before_v.view(-1, kv_heads, dim).clone()
    want_k[slots[:real]], want_v[slots[:real]] = k[:real], v[:real]
    assert torch.equal(key_cache.view(-1, kv_heads, dim), want_k)  # the padding row's slot is untouched
    assert torch.equal(value_cache.view(-1, kv_heads, dim), want_v)
    want = cpu_kernel.decode_attention(fn, q[:real], key_cache, value_cache, block_table[:real], seq_lens[:real], 0.25)
    assert torch.equal(out[:real], want)
    assert torch.equal(out[real:], torch.zeros(rows - real, heads, dim))


@pytest.mark.usefixtures("one_thread")
def test_the_cpp_operators_give_the_python_custom_ops_results_bit_for_bit():
    from executor.models import cpu_fused, cpu_ops

    if not cpu_ops.load():
        pytest.skip("no C++ toolchain: the C++ operators cannot be built here")
    gen = torch.Generator().manual_seed(1)
    x, residual, weight = (torch.randn(5, 96, generator=gen) for _ in range(3))
    weight = weight[0]
    cpp, py = torch.ops.meshserve_cpu, torch.ops.meshserve
    assert torch.equal(cpp.rms_norm(x, weight, 1e-5), py.rms_norm(x, weight, 1e-5))
    r1, r2 = residual.clone(), residual.clone()
    assert torch.equal(cpp.add_rms_norm(x, r1, weight, 1e-5), py.add_rms_norm(x, r2, weight, 1e-5))
    assert torch.equal(r1, r2) and not torch.equal(r1, residual)  # the residual add happened in place
    gate_up = torch.randn(5, 2 * 48, generator=gen)
    assert torch.equal(cpp.silu_mul(gate_up), py.silu_mul(gate_up))
    qkv = torch.randn(5, 10, 16, generator=gen)
    cos, sin = torch.randn(5, 1, 8, generator=gen), torch.randn(5, 1, 8, generator=gen)
    a, b = qkv.clone(), qkv.clone()
    cpp.rotary_(a[:, :8], cos, sin)
    py.rotary_(b[:, :8], cos, sin)
    assert torch.equal(a, b) and not torch.equal(a, qkv)
    assert cpu_fused.load() is not None


def _engine(path, compile: bool, num_threads: int = 1):
    from executor.engine.llm_engine import LLMEngine
    from tests.support.parallel import parallel_config
    import dataclasses

    base = parallel_config(str(path), num_blocks=40)
    return LLMEngine(dataclasses.replace(base, compile=compile, num_threads=num_threads,
                                         batch=dataclasses.replace(base.batch, max_num_seqs=4)))


def test_compiled_decode_gives_the_eager_engines_greedy_tokens(tmp_path):
    """Chunked prefill, prefix hits, decode batches of 1 to 4 (buckets 1, 2, 4; a batch
    of 3 padded to 4): the same tokens as the eager engine, most decode steps compiled."""
    from tests.support.parallel import TINY, save_tiny, workload

    path = save_tiny(tmp_path / "llama", "llama", 2)
    prompts, params = workload(TINY["vocab_size"])
    eager = _engine(path, compile=False).generate(prompts, params)
    engine = _engine(path, compile=True)
    compiled = engine.worker_group.worker.model_runner.compiled_decode
    assert compiled is not None and compiled.buckets == (1, 2, 4)
    assert engine.generate(prompts, params) == eager
    assert compiled.steps > 0


def test_compile_stays_eager_where_it_cannot_run_and_says_why(tmp_path, caplog):
    from tests.support.parallel import save_tiny

    path = save_tiny(tmp_path / "llama", "llama", 2)
    with caplog.at_level(logging.WARNING, logger="executor.worker.worker"):
        engine = _engine(path, compile=True, num_threads=2)
    assert engine.worker_group.worker.model_runner.compiled_decode is None
    assert "--compile ignored: compiled decode needs torch on one thread (its C kernels run one); it runs 2" \
        in caplog.text


def test_the_inductor_cache_goes_under_the_cache_dir_even_after_torch_wrote_its_default(tmp_path, monkeypatch):
    """Inductor writes its /tmp default into TORCHINDUCTOR_CACHE_DIR the first time anything
    asks for its cache folder; compiled decode still puts the cache under
    ``$MESHSERVE_CACHE_DIR/inductor``, and a folder the user set before start wins."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache

    from executor.worker import compiled_decode

    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compiled_decode, "_USER_INDUCTOR_CACHE_DIR", None)
    # torch's default, now in the environment
    assert inductor_cache() != str(tmp_path / "inductor" / compiled_decode.operators_key())
    assert compiled_decode.inductor_cache_dir() == str(tmp_path / "inductor" / compiled_decode.operators_key())
    assert inductor_cache() == str(tmp_path / "inductor" / compiled_decode.operators_key())
    monkeypatch.setattr(compiled_decode, "_USER_INDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled_decode.inductor_cache_dir() == str(tmp_path / "mine")
    # torch's default already in the environment when compiled_decode was imported
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr(compiled_decode, "_USER_INDUCTOR_CACHE_DIR", default_cache_dir())
    assert compiled_decode.inductor_cache_dir() == str(tmp_path / "inductor" / compiled_decode.operators_key())


@pytest.mark.usefixtures("one_thread")
def test_the_compiled_step_writes_the_shared_kv_storage_in_place_without_copying_it(tmp_path):
    """Every layer's caches are views of one allocation (``executor.worker.kv_cache``): the
    compiled step must write them in place. Declaring the cache write as a mutation made
    AOTAutograd copy the whole storage in and out of every step (several times slower
    than eager in serving with a 1 GiB cache); the generated code has no buffer as large
    as one layer's cache, and the step's token lands in the storage."""
    import re

    from torch._inductor.utils import run_and_get_code

    from executor.attention import build_attention_metadata
    from executor.model_loader import load_model
    from executor.worker import compiled_decode
    from executor.worker.kv_cache import allocate_kv_storage, layer_views
    from tests.support.parallel import save_tiny

    loaded = load_model(save_tiny(tmp_path / "llama", "llama", 2), dtype="float32", attention_backend="torch")
    if compiled_decode.unavailable_reason(loaded.model, torch.device("cpu"), loaded.dtype, 1) is not None:
        pytest.skip("the C kernels cannot be built here")
    layers = loaded.model.attention_layers()
    block_size, num_blocks = 4, 64
    storage = allocate_kv_storage(len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim,
                                  torch.float32)
    for layer, cache in zip(layers, layer_views(storage)):
        layer.kv_cache = cache
    compiled = compiled_decode.CompiledDecode(loaded.model, block_size, 64, (2,))
    md = build_attention_metadata([1, 1], [5, 2], [[7, 3], [11]], block_size)  # contexts 5 and 2 tokens
    # compiled afresh: inductor's caches do not key a graph by the operators' schemas
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), torch.inference_mode():
        _, codes = run_and_get_code(compiled.forward, torch.tensor([3, 4]), torch.tensor([5, 2]), md)
    layer_numel = storage[0, 0].numel()
    sizes = [eval(dims) for code in codes for dims in re.findall(r"empty_strided_cpu\((\([0-9, ]*\))", code)]
    assert sizes and max(torch.Size(s).numel() for s in sizes) < layer_numel
    # position 5 of the first request is slot 1 of its second block (3); position 2 of the second, slot 2 of 11
    assert storage[:, :, 3, 1].abs().sum() > 0 and storage[:, :, 11, 2].abs().sum() > 0
    assert storage[:, :, 3, 2:].abs().sum() == 0  # nothing else written
