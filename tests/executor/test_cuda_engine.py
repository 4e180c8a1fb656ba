"""The engine on CUDA with the Triton attention backend (skipped without a GPU).

A tiny random-init Llama (saved with ``save_pretrained``) runs greedy through the
whole engine — chunked prefill, batched decodes, prefix-cache hits — with the
``triton`` backend, and must give exactly the tokens of the ``torch`` backend on
the same device, and of transformers' ``generate`` on the CPU, in float32.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _save_tiny_llama(path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         initializer_range=0.15, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def _hf_greedy(path, prompts, max_new):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=0,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # ignore_eos
        outs.append(gen[0, len(p):].tolist())
    return outs


def test_triton_backend_engine_matches_torch_backend_and_transformers(tmp_path):
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from meshserve.sampling import SamplingParams

    _save_tiny_llama(tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 40, 300, 700)]
    prompts.append(prompts[-1][:500] + [7, 8, 9])   # shares 31 blocks with the 700-token prompt
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("triton", "torch"):
        # graphs off: this test is about the kernels; graphs on vs off is test_cuda_graphs.py's
        engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                        attention_backend=backend, cuda_graphs=False,
                                        cache=CacheConfig(block_size=16, num_blocks=256),
                                        batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128)))
        assert engine.worker_group.worker.model_runner.attention_backend.name == backend
        cold = engine.generate(prompts, params)
        warm = engine.generate(prompts, params)           # served from the prefix cache
        assert warm == cold
        assert engine.stats().prefix_cache_hit_tokens > 0
        engine.check_integrity()
        assert engine.stats().num_free_blocks == 256
        results[backend] = cold
    assert results["triton"] == results["torch"]
    assert results["triton"] == _hf_greedy(tmp_path, prompts, 24)
