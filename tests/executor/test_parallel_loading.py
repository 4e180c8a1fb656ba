"""The single-process parts of tensor parallelism: each rank's shard of the
checkpoint (checked against the unsharded tensors, and read alone from the
file), KV heads replicated when the group has more ranks than KV heads, layouts
a model cannot be split into refused with the sizes it allows, KV blocks
reassembled from the ranks' heads, core shares and the step pipe's frames."""

from __future__ import annotations

import io

import pytest
import torch

from executor.attention import get_backend
from executor.model_loader import check_parallel_sizes
from executor.models.checkpoint import ReadCounter, iter_checkpoint
from executor.models.llama import LlamaForCausalLM
from executor.models.parallel import TensorParallel
from executor.worker.distributed import cpu_shares, encode_frame, read_frame
from executor.worker.kv_connector import KVConnectorWorker, assemble_blocks, block_payloads
from tests.support.parallel import TINY, save_tiny


def _load(path, tp: TensorParallel, counter: ReadCounter | None = None) -> LlamaForCausalLM:
    from transformers import AutoConfig

    model = LlamaForCausalLM(AutoConfig.from_pretrained(path), get_backend("torch"), 256, tp)
    model.load_weights(iter_checkpoint(path, counter))
    return model


@pytest.mark.parametrize("kind,num_kv_heads,world_size", [("llama", 2, 2), ("qwen2", 1, 3)],
                         ids=["llama-2-ranks", "qwen2-3-ranks-kv-replicated"])
def test_rank_shards_put_together_are_the_unsharded_weights(tmp_path, kind, num_kv_heads, world_size):
    path = save_tiny(tmp_path, kind, num_kv_heads)
    full = dict(_load(path, TensorParallel()).named_parameters())
    ranks = [_load(path, TensorParallel(r, world_size)) for r in range(world_size)]
    shards = [dict(m.named_parameters()) for m in ranks]
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    q = TINY["num_attention_heads"] // world_size * head_dim
    for name, whole in full.items():
        parts = [s[name] for s in shards]
        if "qkv_proj" in name:
            kv = head_dim * max(1, num_kv_heads // world_size)
            qs, ks, vs = zip(*[p.split([q, kv, kv]) for p in parts])
            starts = [TensorParallel(r, world_size).kv_head_start(num_kv_heads) for r in range(world_size)]
            owners = [starts.index(h) for h in sorted(set(starts))]  # the first rank holding each KV head
            rebuilt = torch.cat([*qs, *(ks[r] for r in owners), *(vs[r] for r in owners)])
            for r in range(world_size):  # a replicated KV head is the same on each of its ranks
                assert torch.equal(ks[r], ks[owners[sorted(set(starts)).index(starts[r])]])
        elif "gate_up_proj" in name:
            gates, ups = zip(*[p.chunk(2) for p in parts])
            rebuilt = torch.cat([*gates, *ups])
        elif "o_proj.weight" in name or "down_proj.weight" in name:
            rebuilt = torch.cat(parts, dim=1)
        elif "embed_tokens" in name or "lm_head" in name:
            rebuilt = torch.cat(parts)[: TINY["vocab_size"]]
            assert not torch.cat(parts)[TINY["vocab_size"]:].any()  # padding rows stay zero
        elif parts[0].shape == whole.shape:  # norms, row-parallel biases: whole on every rank
            assert all(torch.equal(p, whole) for p in parts)
            continue
        else:  # column-parallel biases (qkv handled above)
            rebuilt = torch.cat(parts)
        assert torch.equal(rebuilt, whole), name


def test_each_rank_reads_only_its_shard(tmp_path):
    path = save_tiny(tmp_path, "llama", 2)
    whole = ReadCounter()
    _load(path, TensorParallel(), whole)
    for rank in range(2):
        counter = ReadCounter()
        model = _load(path, TensorParallel(rank, 2), counter)
        held = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
        padding = 0 if rank == 0 else (-TINY["vocab_size"] % 2) * TINY["hidden_size"]  # zero rows, never read
        assert counter.elements == held - padding
        assert counter.elements < whole.elements * 0.55  # about half, plus the replicated norms


def test_layouts_that_do_not_split_the_model_are_refused_with_the_allowed_sizes():
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY, num_key_value_heads=2)
    check_parallel_sizes(config, 2)
    check_parallel_sizes(config, 6)  # KV heads replicated
    with pytest.raises(ValueError, match=r"tensor-parallel size 4 does not split this model \(6 attention heads, "
                                         r"2 KV heads, intermediate_size 192\).*one of 1, 2, 6$"):
        check_parallel_sizes(config, 4)
    with pytest.raises(ValueError, match="tensor-parallel size 3 .*one of 1, 2, 6"):
        check_parallel_sizes(config, 3)
    with pytest.raises(ValueError, match="pipeline-parallel size 3 exceeds the model's 2 layers"):
        check_parallel_sizes(config, 1, 3)


def test_the_default_model_splits_over_three_ranks_only(default_model_files):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_files.path)
    check_parallel_sizes(config, 3)
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 does not split this model \(9 attention heads, "
                                         r"3 KV heads.*one of 1, 3$"):
        check_parallel_sizes(config, 2)


def test_kv_heads_per_rank_split_or_replicate():
    assert [TensorParallel(r, 3).kv_head_start(3) for r in range(3)] == [0, 1, 2]
    assert [TensorParallel(r, 4).kv_head_start(2) for r in range(4)] == [0, 0, 1, 1]
    assert TensorParallel(0, 4).kv_heads_per_rank(2) == 1 and TensorParallel(0, 2).kv_heads_per_rank(4) == 2
    with pytest.raises(ValueError, match="not a multiple"):
        TensorParallel(0, 3).kv_heads_per_rank(2)


@pytest.mark.parametrize("num_kv_heads,world_size", [(4, 2), (2, 4)], ids=["split", "replicated"])
def test_blocks_load_into_each_ranks_heads_and_reassemble_to_the_same_bytes(num_kv_heads, world_size):
    layers, blocks, block_size, head_dim = 2, 5, 4, 3
    payloads = block_payloads(torch.randn(2, layers, 2, block_size, num_kv_heads, head_dim))
    ranks = []
    for r in range(world_size):
        tp = TensorParallel(r, world_size)
        storage = torch.zeros(layers, 2, blocks, block_size, tp.kv_heads_per_rank(num_kv_heads), head_dim)
        ranks.append(KVConnectorWorker(storage, kv_heads=(tp.kv_head_start(num_kv_heads), num_kv_heads)))
    for worker in ranks:
        assert worker.block_bytes == len(payloads[0])
        worker.load_kv([(3, payloads[0]), (1, payloads[1])])
    parts = [w.save_local([3, 1]) for w in ranks]
    assert block_payloads(assemble_blocks(parts, [0] * world_size, [w.head_start for w in ranks])) == payloads


def test_cores_are_shared_out_to_ranks():
    assert cpu_shares(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert cpu_shares(3, [0, 1, 2, 3]) == [[0], [1], [2]]
    assert cpu_shares(3, [0, 1]) == [[0], [1], [0]]


def test_step_pipe_frames_round_trip_and_a_closed_pipe_is_eof():
    stream = io.BytesIO(encode_frame(("step", {"a": [1, 2]})) + encode_frame(("shutdown",)))
    assert read_frame(stream) == ("step", {"a": [1, 2]})
    assert read_frame(stream) == ("shutdown",)
    with pytest.raises(EOFError):
        read_frame(stream)
    with pytest.raises(EOFError, match="mid-frame"):
        read_frame(io.BytesIO(encode_frame("x")[:-1]))
