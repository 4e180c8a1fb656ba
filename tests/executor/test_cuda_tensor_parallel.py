"""Tensor parallelism over NCCL: two ranks on two GPUs (rank r on ``cuda:r``) give the
greedy tokens of one rank, with chunked prefill, prefix caching and preemption at
work. Skipped, saying why, on a machine with fewer than two CUDA devices (run by
``tests/gpu_check.sh`` when such a machine is lent)."""

from __future__ import annotations

import pytest
import torch

from tests.support.parallel import TINY, parallel_config, save_tiny, workload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"tensor parallel over NCCL needs 2 CUDA devices; this machine has "
                                        f"{torch.cuda.device_count()}")]


def test_two_gpus_generate_the_single_gpu_tokens(tmp_path):
    from dataclasses import replace

    from executor.engine.llm_engine import LLMEngine

    path = str(save_tiny(tmp_path, "llama", 2))
    prompts, params = workload(TINY["vocab_size"])
    single = LLMEngine(replace(parallel_config(path), device="cuda"))
    expected = single.generate(prompts, params)
    assert single.stats().num_preemptions > 0
    group = LLMEngine(replace(parallel_config(path, 2), device="cuda"))
    try:
        assert group.worker_group.worker.device == torch.device("cuda:0")
        assert group.generate(prompts, params) == expected
    finally:
        group.shutdown()
