"""The Triton paged-attention backend (CUDA; Triton's interpreter on CPU for tests).

Per layer (kernels in ``triton_kernels.py``):

1. ``reshape_and_cache`` writes this step's K/V rows into the paged cache at
   ``slot_mapping``.
2. The first ``num_decodes`` requests (one query each) run the split-K decode
   kernel (flash-decoding / vLLM ``paged_attention_v2`` / SGLang decode stage1 +
   stage2) with ``partition_size`` tokens per partition.
3. The prefill chunks run the varlen prefill kernel, reading context and chunk K/V
   from the cache.

``plan`` does the host-side work once per step: the decode grid size (from the
host copy of ``seq_lens``, no device sync) and the prefill work list (one entry
per tile of query tokens), copied to the device once per distinct GQA ratio (so
once per step for any one model) and reused by every layer, as are the decode
split-K buffers.

``plan_static_decode`` is the plan of a pure-decode batch replayed in a CUDA graph
(``executor.worker.cuda_graphs``): the grid is sized for ``max_seq_len`` (the
model's limit), not for this step's longest context, so it holds for every step;
stage-1 programs past a request's last partition return at once, and stage 2
merges only the request's own partitions, so the output equals the eager plan's
bit for bit (a single partition's merge is ``acc / 1``). Its split-K buffers are
views of one buffer per head shape, sized by the first (largest) batch planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor.attention.backend import AttentionBackend, KVCache
from executor.attention.metadata import AttentionMetadata


@dataclass
class _TritonPlan:
    num_decodes: int
    decode_max_seq_len: int          # longest decode context (tokens); 0 without decodes
    decode_partitions: int           # split-K partitions of the longest decode context
    has_prefill: bool
    # per query tile size (GQA ratio, dtype): block_q -> (tile_req, tile_q0), each (num_tiles,) int32 on the device
    prefill_tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # per (num_heads, head_dim): the decode split-K buffers (mid_o, mid_lse), float32
    workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # static plans: per (num_heads, head_dim), buffers shared by all static plans (sliced to num_decodes)
    shared_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels: split-K decode, varlen prefill over a cached prefix.

    Args:
        partition_size: decode tokens per split-K partition (a power of two >= 16);
            default ``triton_kernels.DEFAULT_PARTITION_SIZE``.

    Raises:
        ImportError: triton is not installed.
    """

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, partition_size: int | None = None):
        from executor.attention import triton_kernels  # imports triton: only when the backend is used

        self.kernels = triton_kernels
        self._static_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.partition_size = partition_size or triton_kernels.DEFAULT_PARTITION_SIZE
        if self.partition_size < 16 or self.partition_size & (self.partition_size - 1):
            raise ValueError(f"partition_size must be a power of two >= 16, got {self.partition_size}")

    def plan(self, md: AttentionMetadata) -> None:
        max_decode = max(md.seq_lens_cpu[: md.num_decodes], default=0)
        md.plan = _TritonPlan(
            num_decodes=md.num_decodes,
            decode_max_seq_len=max_decode,
            decode_partitions=self.kernels.decode_num_partitions(max_decode, self.partition_size),
            has_prefill=md.num_reqs > md.num_decodes,
        )

    def plan_static_decode(self, md: AttentionMetadata, max_seq_len: int) -> None:
        if md.num_decodes != md.num_reqs:
            raise ValueError("a static decode plan needs a batch of decodes only")
        md.plan = _TritonPlan(
            num_decodes=md.num_decodes,
            decode_max_seq_len=max_seq_len,
            decode_partitions=self.kernels.decode_num_partitions(max_seq_len, self.partition_size),
            has_prefill=False,
            shared_workspaces=self._static_workspaces,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        if md.plan is None:
            self.plan(md)
        plan: _TritonPlan = md.plan
        key_cache, value_cache = kv_cache
        kernels = self.kernels
        kernels.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_heads, head_dim = q.shape[1:]
        nd = plan.num_decodes
        if nd:
            kernels.paged_decode_attention(
                out[:nd], q[:nd], key_cache, value_cache, md.block_table, md.seq_lens, scale,
                plan.decode_max_seq_len, self.partition_size, self._workspace(plan, nd, num_heads, head_dim, q.device))
        if plan.has_prefill:
            tile_req, tile_q0 = self._prefill_tiles(plan, md, num_heads // key_cache.shape[2], q.dtype)
            kernels.paged_prefill_attention(out, q, key_cache, value_cache, md.block_table, md.seq_lens,
                                            md.query_start_loc, tile_req, tile_q0, scale)
        return out

    @staticmethod
    def _workspace(plan: _TritonPlan, num_decodes: int, num_heads: int, head_dim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if plan.decode_partitions == 1:
            return None
        key = (num_heads, head_dim)
        if key not in plan.workspaces:
            p = plan.decode_partitions
            shared = plan.shared_workspaces if plan.shared_workspaces is not None else {}
            buffers = shared.get(key)
            if buffers is None or buffers[0].shape[0] < num_decodes or buffers[0].shape[2] != p:
                # a plan made earlier keeps its views of the old buffer alive
                buffers = (torch.empty(num_decodes, num_heads, p, head_dim, dtype=torch.float32, device=device),
                           torch.empty(num_decodes, num_heads, p, dtype=torch.float32, device=device))
                shared[key] = buffers
            plan.workspaces[key] = (buffers[0][:num_decodes], buffers[1][:num_decodes])
        return plan.workspaces[key]

    def _prefill_tiles(self, plan: _TritonPlan, md: AttentionMetadata, group: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        block_q = self.kernels.prefill_block_q(group, dtype)
        if block_q not in plan.prefill_tiles:
            reqs, q0s = self.kernels.prefill_work_list(md.query_start_loc_cpu, md.num_decodes, block_q)
            device = md.query_start_loc.device
            both = torch.tensor([reqs, q0s], dtype=torch.int32).to(device)
            plan.prefill_tiles[block_q] = (both[0], both[1])
        return plan.prefill_tiles[block_q]
