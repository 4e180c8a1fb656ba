"""Column- and row-parallel linear layers with ``weight_loader`` methods.

Megatron-LM's split of a transformer block over ``world_size`` ranks
(Shoeybi et al., 2019), in vLLM's layer vocabulary:

* ``ColumnParallelLinear``: ``W`` of shape ``(out, in)`` is split along ``out``;
  each rank computes its slice of the output, no communication.
* ``MergedColumnParallelLinear``: several column-parallel matrices stacked
  (``gate_proj`` and ``up_proj``): one matmul instead of two.
* ``QKVParallelLinear``: ``q_proj``, ``k_proj``, ``v_proj`` stacked, split by heads.
* ``RowParallelLinear``: ``W`` split along ``in``; each rank's partial product
  is summed with an all-reduce (``o_proj``, ``down_proj``).

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that
copies this rank's part of a checkpoint tensor into its place, so the model
loader never needs to know how a layer is sharded. ``loaded`` is a tensor or a
lazy ``checkpoint.CheckpointTensor``: a loader narrows it to this rank's part
before anything is read, so each rank reads only its shard of the file. Once all weights are in,
``process_weights_after_loading()`` packs each weight for the CPU GEMM
(``cpu_gemm.py``); a layer whose weight cannot be packed keeps using ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.models import cpu_fused, cpu_gemm, cpu_gemm_silu
from executor.models.checkpoint import CheckpointTensor, attach_weight_loader, materialize
from executor.models.parallel import SINGLE, TensorParallel


PACKED_COPIES = ("packed_weight", "silu_packed")
"""The attributes in which a layer keeps a packed copy of its weight (``cpu_gemm.pack``,
``cpu_gemm_silu.pack_silu_mul``): stale once the weight changes, remade by
``process_weights_after_loading``."""


def packed_copies(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's packed copies of its weight, by attribute (empty for a module without)."""
    return {name: getattr(module, name) for name in PACKED_COPIES if hasattr(module, name)}


def set_packed_copies(module: nn.Module, copies: dict[str, torch.Tensor | None]) -> None:
    """Sets the module's packed copies (``packed_copies``' form; None drops one)."""
    for name, value in copies.items():
        setattr(module, name, value)


def _copy(param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(materialize(loaded))


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split along the output dimension.

    Args:
        input_size: ``in`` features.
        output_size: ``out`` features over the whole group.
        bias: add a bias (split like the output).
        tp: the tensor-parallel group.
        dtype: parameter dtype.

    Shapes: ``x`` ``(num_tokens, in)`` → ``(num_tokens, out / world_size)``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size_per_rank = tp.shard_size(output_size, "output_size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size, dtype=dtype), requires_grad=False)
        attach_weight_loader(self.weight, self)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_rank, dtype=dtype), requires_grad=False)
            attach_weight_loader(self.bias, self)
        self.packed_weight: torch.Tensor | None = None  # cpu_gemm.pack(weight), once loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's rows of the full ``(out, in)`` weight (or ``(out,)`` bias)."""
        n = param.shape[0]
        _copy(param, loaded.narrow(0, self.tp.rank * n, n))

    def process_weights_after_loading(self) -> None:
        """Packs the loaded weight for the CPU GEMM (nothing on other devices)."""
        self.packed_weight = cpu_gemm.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel layers of the same input stacked along ``out`` (e.g.
    ``[gate_proj; up_proj]``); ``shard_id`` is the index of the stacked matrix.

    With ``silu_mul`` (two stacked matrices, SwiGLU's gate and up), the layer also offers
    ``forward_silu_mul``: ``silu(gate) * up`` of its outputs. Where the AMX GEMM can
    compute that in one pass (``cpu_gemm_silu.pack_silu_mul``: bfloat16 on one thread on a CPU
    with AMX-BF16), the weight is packed for it only (``silu_packed``; ``packed_weight``
    None): ``forward`` then multiplies on those panels and puts the columns back in order,
    bitwise its output on the plain panels.

    Shapes: ``x`` ``(num_tokens, in)`` → ``(num_tokens, sum(output_sizes) / world_size)``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32, silu_mul: bool = False):
        self.output_sizes = [tp.shard_size(s, "output_size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp, dtype)
        if silu_mul and (len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(f"silu_mul takes a gate and an up matrix of one size, not {output_sizes}")
        self.silu_mul = silu_mul
        self.silu_packed: torch.Tensor | None = None  # cpu_gemm_silu.pack_silu_mul(weight), once loaded

    def process_weights_after_loading(self) -> None:
        """Packs the loaded weight for the fused SiLU GEMM where it is to be had, else for
        the CPU GEMM."""
        self.silu_packed = cpu_gemm_silu.pack_silu_mul(self.weight) if self.silu_mul else None
        self.packed_weight = None if self.silu_packed is not None else cpu_gemm.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_packed is None or x.dtype != torch.bfloat16:
            return super().forward(x)
        return cpu_gemm_silu.silu_panels_linear_bf16(x, self.silu_packed, tuple(self.weight.shape), self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this layer's outputs for ``x`` ``(num_tokens, in)`` →
        ``(num_tokens, out / 2 / world_size)`` in one fused GEMM where the weight is packed
        for it (bitwise the GEMM then ``cpu_fused.silu_mul``), else ``None``: the caller runs
        ``forward`` and the activation itself."""
        if (self.silu_packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu"
                or torch.get_num_threads() != 1 or torch.compiler.is_compiling() or cpu_fused.load() is None):
            return None  # (the fused kernels switched off: the torch activation after forward)
        return cpu_gemm_silu.silu_mul_linear_bf16(x, self.silu_packed, tuple(self.weight.shape), self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's rows of stacked matrix number ``shard_id`` into its slice."""
        assert isinstance(shard_id, int), "MergedColumnParallelLinear needs an integer shard_id"
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        _copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """``[q_proj; k_proj; v_proj]`` as one column-parallel matmul, split by heads.

    Args:
        hidden_size: input features.
        head_dim: features per head.
        num_heads: query heads over the group.
        num_kv_heads: key/value heads over the group (GQA when fewer than ``num_heads``).

    Shapes: ``x`` ``(num_tokens, hidden_size)`` → ``(num_tokens, (q + 2 kv) * head_dim)``
    with ``q = num_heads / world_size`` and ``kv = num_kv_heads / world_size``, or
    ``kv = 1`` when the group has more ranks than KV heads: each KV head is then
    replicated on ``world_size / num_kv_heads`` ranks (vLLM's ``num_kv_head_replicas``;
    ``TensorParallel.kv_heads_per_rank``). ``shard_id`` is ``"q"``, ``"k"`` or ``"v"``.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32):
        self.head_dim = head_dim
        self.num_heads = tp.shard_size(num_heads, "num_attention_heads")
        self.num_kv_heads = tp.kv_heads_per_rank(num_kv_heads)
        self.kv_head_start = tp.kv_head_start(num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        kv_total = self.num_kv_heads * tp.world_size  # with replicas counted
        super().__init__(hidden_size, (num_heads + 2 * kv_total) * head_dim, bias, tp, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's heads of ``q_proj``/``k_proj``/``v_proj`` (``shard_id``) into place."""
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        offset, size = offsets[shard_id]  # type: ignore[index]
        start = self.tp.rank * size if shard_id == "q" else self.kv_head_start * self.head_dim
        _copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split along the input dimension, summed over the group.

    Shapes: ``x`` ``(num_tokens, in / world_size)`` → ``(num_tokens, out)``. The bias is
    added once, after the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp
        self.input_size_per_rank = tp.shard_size(input_size, "input_size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank, dtype=dtype), requires_grad=False)
        attach_weight_loader(self.weight, self)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            attach_weight_loader(self.bias, self)
        self.packed_weight: torch.Tensor | None = None  # cpu_gemm.pack(weight), once loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's columns of the full ``(out, in)`` weight; the bias whole."""
        if param.dim() == 1:
            _copy(param, loaded)
            return
        n = param.shape[1]
        _copy(param, loaded.narrow(1, self.tp.rank * n, n))

    def process_weights_after_loading(self) -> None:
        """Packs the loaded weight for the CPU GEMM (nothing on other devices)."""
        self.packed_weight = cpu_gemm.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return cpu_gemm.linear(x, self.weight, self.bias, self.packed_weight)
        y = self.tp.all_reduce(cpu_gemm.linear(x, self.weight, None, self.packed_weight))
        return y if self.bias is None else y + self.bias


def _copy_into(dst: torch.Tensor, loaded: torch.Tensor | CheckpointTensor) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit slice {tuple(dst.shape)}")
    dst.copy_(materialize(loaded))
