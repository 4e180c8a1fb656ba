"""The decoder layers of a step in one C call (``cpu_decoder_stack.c``) where every token
is a row of the CPU decode-attention kernel: decode-only steps and steps of short prefill
chunks, on a CPU running torch on one thread, float32 or bfloat16, one rank.

The eager layers (``executor.models.llama``) call C kernels for all their work there (the
GEMMs on packed panels, the fused norm, rotary and SiLU-and-multiply, or on AMX the GEMM that
applies the SiLU as it writes, the paged decode attention), yet spend about as long again
between them in Python: module calls, argument checks, views, fresh tensors.
``cpu_decoder_stack.c`` calls the same kernels through their function pointers, in the
same order, on the same inputs, so its outputs are
bitwise the eager path's (tested), without that Python: one decode step of SmolLM2-135M
(forward + logits) in bfloat16 on one Zen 4 core, 1 request 23.9 -> 16.5 ms, 32 requests
68.3 -> 55.8 ms (``python -m meshserve.bench.cpu_decoder_stack``; ``reports/cpu-speed/``).
The pointer tables are built once per model and rebuilt whenever a layer's KV cache, norm
weight or bias is another tensor, or at another address, than the table names (caches rebound; parameters replaced by
``load_state_dict(..., assign=True)`` or moved by ``param.data = ...``, as ``share_memory()``
does: their old memory may be freed); a step whose layers no longer hold the panels it was
built with runs eagerly. Parameters are read through their pointers: updated in place
(``copy_``) they are seen; a replaced linear weight needs ``process_weights_after_loading``
(its panels are a packed copy), which builds the driver again.

Anything else (several threads, a GPU, tensor parallelism, a GEMM without panels, a
step with SDPA or prefill-kernel work, ``torch.compile`` tracing) runs the eager layers;
``MESHSERVE_CPU_DECODER_STACK=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from executor.attention import cpu_kernel
from executor.attention.metadata import AttentionMetadata
from executor.attention.torch_plan import TorchPlan
from executor.models import cpu_fused, cpu_gemm

SOURCE = Path(__file__).with_name("cpu_decoder_stack.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
SWITCH = "MESHSERVE_CPU_DECODER_STACK"
_lock = threading.Lock()
_loaded: dict[str, object] = {}
_UNSET = object()
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Stack(ctypes.Structure):
    _fields_ = [("gemm", _P), ("norm", _P), ("rotary", _P), ("silu", _P), ("attention", _P), ("gemm_silu", _P),
                ("silu_table", _P), ("bf16", _I64), ("lanes", _I64), ("hidden", _I64), ("heads", _I64),
                ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64), ("block_size", _I64), ("eps", _F),
                ("scale", _F)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("norm1", "qkv", "qkv_bias", "o", "o_bias", "norm2", "gate_up",
                                        "gate_up_bias", "down", "down_bias", "key_cache", "value_cache")]


def _bind(lib: ctypes.CDLL):
    run = lib.decoder_stack
    run.restype = ctypes.c_int32
    run.argtypes = [_P, _P, _I64, _P, _P, ctypes.c_int32, _I64, _P, _P, _P, _P, _I64, _P, _P]
    scratch = lib.stack_scratch_bytes
    scratch.restype, scratch.argtypes = _I64, [_P, _I64]
    return run, scratch


def load():
    """``(decoder_stack, stack_scratch_bytes)`` as ``ctypes`` functions, built if needed;
    ``None`` where they cannot be (no compiler, a failed build, ``MESHSERVE_CPU_DECODER_STACK=0``).
    Once per process."""
    fns = _loaded.get("fns", _UNSET)
    if fns is not _UNSET:
        return fns
    with _lock:
        if "fns" not in _loaded:
            _loaded["fns"] = cpu_kernel.build_and_load("CPU decoder-stack driver", SOURCE, FLAGS, SWITCH,
                                                       "the eager decoder layers", _bind)
        return _loaded["fns"]


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _panels(linear) -> torch.Tensor | None:
    """The packed panels a linear layer's GEMM reads: its fused SiLU packing where it has one
    (``MergedColumnParallelLinear.silu_packed``), else its ``packed_weight``."""
    silu_packed = getattr(linear, "silu_packed", None)
    return silu_packed if silu_packed is not None else linear.packed_weight


def _fits(t: torch.Tensor, dtype: torch.dtype, numel: int) -> bool:
    """Whether the C can read ``t`` as ``numel`` contiguous values of ``dtype`` on the CPU."""
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() and t.numel() == numel


class DecoderStack:
    """The C driver bound to one model's layers (``LlamaForCausalLM.layers``).

    Build it with ``DecoderStack.for_model``, which returns ``None`` where the driver
    cannot run this model at all; ``run`` then returns ``None`` for a step it does not take.
    """

    def __init__(self, fns, stack: _Stack, layers, linears: list, dtype: torch.dtype):
        self._run, self._scratch_bytes = fns
        self._stack, self._layers, self.dtype = stack, layers, dtype
        self._linears = linears  # every layer's four linear modules, in table order
        self._packed = [_panels(m) for m in linears]  # the panels the table names (held: never freed under it)
        self._attention = [layer.self_attn.attn for layer in layers]  # (a module lookup a layer a step saved)
        qkv = (stack.heads + 2 * stack.kv_heads) * stack.head_dim
        # each layer's norm weights and biases in table order: where the module keeps it (a
        # parameter replaced by load_state_dict(assign=True) is found there), its size, None allowed
        self._params = [(module._parameters, name, size, name == "bias") for layer in layers
                        for module, name, size in (
                            (layer.input_layernorm, "weight", stack.hidden), (layer.self_attn.qkv_proj, "bias", qkv),
                            (layer.self_attn.o_proj, "bias", stack.hidden),
                            (layer.post_attention_layernorm, "weight", stack.hidden),
                            (layer.mlp.gate_up_proj, "bias", 2 * stack.inter),
                            (layer.mlp.down_proj, "bias", stack.hidden))]
        self._named: list | None = None  # (tensor, address) of each norm weight, bias and KV cache the table names
        self._slots = 0  # the caches' slots (num_blocks * block_size)
        self._table = None
        self._taken = None  # (metadata, table) of the step takes() last said yes to: run() checks nothing twice

    @classmethod
    def for_model(cls, layers, dtype: torch.dtype) -> DecoderStack | None:
        """The driver for ``layers`` (``LlamaDecoderLayer``s of one rank, packed for the CPU
        GEMM), or None: a dtype other than float32/bfloat16, tensor parallelism, a linear
        layer without panels, a norm weight or bias of another dtype, a missing kernel, or
        the switch off."""
        if os.environ.get(SWITCH, "1") == "0" or dtype not in (torch.float32, torch.bfloat16) or not len(layers):
            return None
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(m.tp.world_size != 1 or not cpu_gemm.is_panel_packed(_panels(m))
               or _panels(m).dtype != dtype or m.weight.device.type != "cpu"
               or (m.bias is not None and m.bias.dtype != dtype) for m in linears):
            return None
        fused_silu = {getattr(layer.mlp.gate_up_proj, "silu_packed", None) is not None for layer in layers}
        if len(fused_silu) != 1:
            return None  # some layers' gate_up packed for the fused SiLU GEMM and some not
        if any(norm.weight.dtype != dtype for layer in layers
               for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None  # the eager norm keeps the torch ops there
        gemm = cpu_gemm.load_bf16() if dtype == torch.bfloat16 else cpu_gemm.load()
        fused, attention, fns = cpu_fused.load(), cpu_kernel.load(), load()
        if gemm is None or fused is None or attention is None or fns is None:
            return None
        bf16 = dtype == torch.bfloat16
        eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
        if len(eps) != 1:
            return None
        stack = _Stack(
            gemm=_address(gemm.packed_gemm),
            norm=_address(fused.add_rms_norm_bf16 if bf16 else fused.add_rms_norm),
            rotary=_address(fused.rotary_inplace_bf16 if bf16 else fused.rotary_inplace),
            silu=_address(fused.silu_mul_bf16 if bf16 else fused.silu_mul),
            attention=_address(attention), bf16=int(bf16), lanes=fused.lanes,
            gemm_silu=_address(gemm.packed_gemm_silu) if True in fused_silu else None,
            silu_table=fused.silu_table if True in fused_silu else None,
            hidden=attn.qkv_proj.weight.shape[1], heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, inter=mlp.down_proj.weight.shape[1], block_size=0, eps=eps.pop(),
            scale=attn.attn.scale)
        return cls(fns, stack, layers, linears, dtype)

    def _layer_table(self):
        """The layers' pointer table, or None where a layer's tensors are not what the kernels
        read (a KV cache unbound, or not contiguous, of the model's dtype and geometry; a norm
        weight or bias not a contiguous CPU tensor of the model's dtype and size: the eager
        layers, which check theirs, run then). Rebuilt whenever a norm weight, a bias or a KV
        cache is not the tensor, at the address, that it names: caches rebound, parameters
        replaced (``load_state_dict(..., assign=True)``) or moved (``param.data = ...``, as
        ``nn.Module._apply`` and ``share_memory()`` do), whose old memory may be freed."""
        tensors = [params.get(name) for params, name, _, _ in self._params]
        for attention in self._attention:
            if attention.kv_cache is None:
                self._named = self._table = None  # (and the caches it named are not held)
                return None
            tensors += attention.kv_cache
        named = self._named
        if named is not None and all(t is held and (t is None or t.data_ptr() == address)
                                     for t, (held, address) in zip(tensors, named)):
            return self._table
        self._named = self._table = None
        params, caches = tensors[:len(self._params)], tensors[len(self._params):]
        for t, (_, _, size, optional) in zip(params, self._params):
            if not (_fits(t, self.dtype, size) if t is not None else optional):
                return None
        s = self._stack
        block_size = caches[0].shape[1] if caches[0].dim() == 4 else 0
        if not all(_fits(c, self.dtype, c.numel()) and c.shape == caches[0].shape and c.dim() == 4
                   and tuple(c.shape[1:]) == (block_size, s.kv_heads, s.head_dim) for c in caches):
            return None
        table = (_Layer * len(self._layers))()
        per_layer = len(self._params) // len(self._layers)
        for i, (entry, layer) in enumerate(zip(table, self._layers)):
            norm1, qkv_bias, o_bias, norm2, gate_up_bias, down_bias = params[i * per_layer:(i + 1) * per_layer]
            a, m = layer.self_attn, layer.mlp
            entry.norm1, entry.norm2 = _ptr(norm1), _ptr(norm2)
            entry.qkv, entry.qkv_bias = _ptr(a.qkv_proj.packed_weight), _ptr(qkv_bias)
            entry.o, entry.o_bias = _ptr(a.o_proj.packed_weight), _ptr(o_bias)
            entry.gate_up, entry.gate_up_bias = _ptr(_panels(m.gate_up_proj)), _ptr(gate_up_bias)
            entry.down, entry.down_bias = _ptr(m.down_proj.packed_weight), _ptr(down_bias)
            entry.key_cache, entry.value_cache = caches[2 * i].data_ptr(), caches[2 * i + 1].data_ptr()
        s.block_size, self._slots = block_size, caches[0].shape[0] * block_size
        self._named, self._table = [(t, None if t is None else t.data_ptr()) for t in tensors], table
        return table

    def takes(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata) -> bool:
        """Whether ``run`` takes this step: every token a decode-kernel row (a decode-only
        plan of the torch backend's kernel, or its token rows), torch on one thread, ``x``
        and the rotary table of the model's dtype, every layer's KV cache bound, contiguous,
        of that dtype, and every slot of ``md.slot_mapping`` in the caches."""
        plan = md.plan
        if any(_panels(m) is not p for m, p in zip(self._linears, self._packed)):
            return False  # panels dropped or replaced (load_weights, a benchmark's plain F.linear side)
        if (not isinstance(plan, TorchPlan) or x.dtype != self.dtype or x.device.type != "cpu" or x.dim() != 2
                or rope[0].dtype != self.dtype or torch.get_num_threads() != 1 or torch.compiler.is_compiling()):
            return False
        if plan.tokens is None and not (plan.decodes is None and not plan.prefills and plan.prefill_rows is None
                                        and plan.split is None and plan.num_decodes == md.num_tokens):
            return False
        if self._layer_table() is None:
            return False
        # the C copies the K and V rows to their slots unchecked: a slot outside the caches (a
        # metadata bug) goes to the eager layers, whose index_copy_ raises IndexError there
        slots = md.slot_mapping
        if (slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous() or len(slots) != len(x)
                or not len(x)):
            return False
        low, high = torch.aminmax(slots)
        if not (int(low) >= 0 and int(high) < self._slots):
            return False
        self._taken = (md, self._table)
        return True

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
            md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over ``x`` ``(num_tokens, hidden)`` (``residual`` None at the model's
        first layer, ``x`` the embeddings), as ``LlamaForCausalLM.run_layers``; ``rope`` the
        step's ``RotaryEmbedding.lookup``. Call it only where ``takes`` said yes.

        Raises:
            MemoryError: a kernel could not allocate its scratch memory.
        """
        taken, self._taken = self._taken, None
        table = taken[1] if taken is not None and taken[0] is md else self._layer_table()  # just checked by takes()
        if table is None:
            raise RuntimeError("the decoder stack was run on a step it does not take (see takes)")
        plan: TorchPlan = md.plan
        if plan.tokens is not None:
            block_table, seq_lens = plan.tokens.block_table, plan.tokens.seq_lens
        else:
            block_table, seq_lens = md.block_table, md.seq_lens
        n = x.shape[0]
        x = x.contiguous()
        has_residual = residual is not None
        residual = residual.contiguous() if has_residual else torch.empty_like(x)
        cos, sin = (t.contiguous() for t in rope)
        stack = ctypes.byref(self._stack)
        scratch = torch.empty(self._scratch_bytes(stack, n), dtype=torch.uint8)
        rc = self._run(stack, table, len(self._layers), x.data_ptr(), residual.data_ptr(), int(has_residual), n,
                       cos.data_ptr(), sin.data_ptr(), md.slot_mapping.data_ptr(), block_table.data_ptr(),
                       block_table.stride(0), seq_lens.data_ptr(), scratch.data_ptr())
        if rc:
            raise MemoryError("a CPU kernel of the decoder stack could not allocate its scratch memory")
        return x, residual
