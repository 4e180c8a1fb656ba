"""The Llama family (Llama, Qwen2, Mistral) over a flattened, unpadded batch.

One decoder layer::

    x ─▶ RMSNorm ─▶ qkv_proj ─▶ rope(q, k) ─▶ paged attention ─▶ o_proj ─▶ (+x) ─▶ h
    h ─▶ RMSNorm ─▶ gate_up_proj ─▶ silu(gate) * up ─▶ down_proj ─▶ (+h)

Architecture differences are config flags: Qwen2 has q/k/v biases; Llama's
``attention_bias``/``mlp_bias`` add biases; Mistral's ``sliding_window`` is
handled by the engine capping ``max_model_len`` at the window (so attention is
always full causal). ``lm_head`` is the embedding when ``tie_word_embeddings``.

Layers are the tensor-parallel ones of ``linear.py``: ``qkv_proj`` and
``gate_up_proj`` column-parallel (fused), ``o_proj`` and ``down_proj`` row-parallel.

The hot path is written for CPU decode, where each op's fixed cost matters: the
rotary cos/sin are looked up once per step, not per layer; rotary rotates the
query and key heads of the QKV output in place; the residual adds are folded
into the norms (in place); SiLU-and-multiply makes one new tensor. In float32 and
bfloat16 on one CPU thread the norms, the rotary and SiLU-and-multiply are each one call
of a small C kernel (``cpu_fused.py``; the norm and rotary bitwise, SiLU within a last
bit). The
torch ops keep the reference's roundings (float32 norms and rotary are bitwise those of
``transformers``); the matmuls, packed for oneDNN on CPU (``cpu_gemm.py``), round
differently from MKL's, within float32 noise.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from executor.attention import Attention, AttentionBackend, AttentionMetadata
from executor.models import cpu_fused
from executor.models.checkpoint import materialize
from executor.models.cpu_decoder_stack import DecoderStack
from executor.models.embedding import ParallelLMHead, VocabParallelEmbedding
from executor.models.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                    packed_copies, set_packed_copies)
from executor.models.norm import RMSNorm
from executor.models.parallel import SINGLE, PipelineStage, TensorParallel
from executor.models.rotary import RotaryEmbedding, head_dim_of, rope_inv_freq

_LAYER = re.compile(r"layers\.(\d+)\.(.*)")
_UNBUILT = object()

# checkpoint name fragment -> (our parameter fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaAttention(nn.Module):
    """Self-attention with rotary positions and grouped-query heads."""

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend, tp: TensorParallel,
                 dtype: torch.dtype):
        super().__init__()
        head_dim = head_dim_of(config)
        qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=attention_bias or qwen2, tp=tp, dtype=dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=attention_bias and not qwen2, tp=tp, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, backend)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """``rope``: the step's ``RotaryEmbedding.lookup``; ``x`` ``(num_tokens, hidden)``."""
        qkv = self.qkv_proj(x)
        n, q_heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        heads = qkv.view(n, q_heads + 2 * kv_heads, self.head_dim)
        self.rotary.rotate_(heads[:, : q_heads + kv_heads], *rope)  # q and k heads together, in place
        q, k, v = heads.split([q_heads, kv_heads, kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, md))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias, tp=tp, dtype=dtype,
                                                       silu_mul=True)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, tp=tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.forward_silu_mul(x) if x.dim() == 2 else None
        if act is not None:  # bfloat16 on an AMX CPU: the GEMM applies the activation as it writes
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        kernels = cpu_fused.usable(gate_up) if gate_up.dim() == 2 and gate_up.is_contiguous() else None
        if kernels is not None:  # float32 or bfloat16 on one CPU thread: one C call (cpu_fused.py)
            return self.down_proj(cpu_fused.silu_mul(kernels, gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual.

    The residual stream is carried separately (vLLM's layout): a layer takes the
    previous layer's MLP output ``x`` and the ``residual`` before it, adds them in
    its first norm, and returns its own MLP output and residual::

        residual += x;  h = attn(norm1(residual));  residual += h;  x = mlp(norm2(residual))

    which is ``x + attn(norm1(x))`` then ``+ mlp(norm2(...))`` of the reference.
    """

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend, tp: TensorParallel,
                 dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, rotary, backend, tp, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, tp, dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``residual`` ``(num_tokens, hidden)`` (``residual`` ``None`` at the first
        layer, whose ``x`` is the embedding) → this layer's ``(x, residual)``."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a flattened batch with a paged KV cache.

    Args:
        config: a ``transformers`` Llama, Qwen2 or Mistral config.
        backend: the attention backend (shared by all layers).
        max_positions: positions supported by the rotary table (``max_model_len``).
        tp: tensor-parallel group.
        dtype: parameter and activation dtype (float32 or bfloat16).
        pp: the pipeline stage this model holds (default: all layers). Only the
            stage's layers are built and loaded; stage 0 also holds the embedding,
            the final norm and the LM head, so the last stage sends its output back
            to stage 0 (``executor.worker.pipeline``).
    """

    def __init__(self, config, backend: AttentionBackend, max_positions: int, tp: TensorParallel = SINGLE,
                 dtype: torch.dtype = torch.float32, pp: PipelineStage | None = None):
        super().__init__()
        self.config = config
        self.pp = pp or PipelineStage(0, 1, config.num_hidden_layers)
        self.first_layer = self.pp.layers.start
        inv_freq, scaling = rope_inv_freq(config)
        self.rotary = rotary = RotaryEmbedding(inv_freq, max_positions, scaling, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, backend, tp, dtype) for _ in self.pp.layers)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.decoder_stack: DecoderStack | None | object = _UNBUILT  # the C driver (cpu_decoder_stack), once packed
        self.embed_tokens = self.norm = self.lm_head = None
        if self.pp.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

    def attention_layers(self) -> list[Attention]:
        """The attention layer of each decoder layer, in order (for binding KV caches)."""
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Runs the decoder stack.

        Args:
            input_ids: ``(num_tokens,)`` int64 token ids of the flattened batch.
            positions: ``(num_tokens,)`` int64 position of each token in its sequence.
            md: the step's attention metadata.

        Returns:
            ``(num_tokens, hidden_size)`` final-normed hidden states, model dtype.
        """
        return self.final_norm(*self.run_layers(self.embed(input_ids), None, positions, md))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(num_tokens,)`` ids → ``(num_tokens, hidden_size)`` embeddings (stage 0)."""
        return self.embed_tokens(input_ids)

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's decoder layers over ``x`` (``residual`` None at the first layer
        of the model): the ``(x, residual)`` pair the next stage continues from."""
        rope = self.rotary.lookup(positions)
        if not torch.compiler.is_compiling():  # (a compiled graph holds the layers' ops instead)
            if self.decoder_stack is _UNBUILT:  # once packed: the layers' parameters never move after
                self.decoder_stack = DecoderStack.for_model(self.layers, self.rotary.cos.dtype)
            if self.decoder_stack is not None and self.decoder_stack.takes(x, rope, md):  # one C call
                return self.decoder_stack.run(x, residual, rope, md)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, md)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's ``(x, residual)`` → final-normed hidden states (stage 0)."""
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(num_reqs, hidden_size)`` hidden states (one row per request that samples)
        → ``(num_reqs, vocab_size)`` float32 logits."""
        return self.lm_head.compute_logits(hidden).float()

    def process_weights_after_loading(self) -> None:
        """Lets every layer prepare its loaded weights for its device (packs the CPU
        GEMM weights: ``linear.py``, ``cpu_gemm.py``). Call it last, after
        ``load_weights`` and after moving the model; ``load_weights`` drops the packed
        copies, so layers use ``F.linear`` until it is called again."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        self.decoder_stack = _UNBUILT  # bound to the new packed weights at the next step

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint name as this stage's parameter name (layer indices made local),
        or None when another stage holds it."""
        match = _LAYER.match(name)
        if match is not None:
            index = int(match.group(1))
            if index not in self.pp.layers:
                return None
            return f"layers.{index - self.first_layer}.{match.group(2)}"
        if not self.pp.is_first and name.split(".")[0] in ("embed_tokens", "norm", "lm_head"):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads checkpoint tensors named as in ``transformers`` (``model.layers.0.self_attn.q_proj.weight``…).

        Returns:
            Names of our parameters that were loaded.

        Raises:
            KeyError: a checkpoint tensor has no parameter to go to.
        """
        self.decoder_stack = None  # its pointers go stale with the packed copies, until process_weights_after_loading
        for module in self.modules():  # packed copies go stale: process_weights_after_loading() again
            set_packed_copies(module, dict.fromkeys(packed_copies(module)))
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            name = name.removeprefix("model.")
            name = self._stage_name(name)
            if name is None:
                continue  # another pipeline stage's tensor
            shard_id = None
            for ckpt, ours, sid in _STACKED:
                if ckpt in name:
                    name, shard_id = name.replace(ckpt, ours), sid
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(materialize(tensor))
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
        return loaded
