"""Which tensor- and pipeline-parallel sizes a model can be split into, checked from
its ``config.json`` alone (no torch, no transformers: ``meshserve executor`` refuses
a bad size in about a second, before anything heavy is imported or any rank starts).

Tensor parallel (Megatron-LM's split, ``executor.models.parallel``): the size must
divide the attention heads and the MLP's ``intermediate_size``, and divide or be a
multiple of the KV heads (KV heads are then replicated, as vLLM does). Pipeline
parallel: at most one stage per layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that decide how it can be split.

    Attributes:
        num_attention_heads: query heads per layer.
        num_key_value_heads: KV heads per layer (= query heads without GQA).
        intermediate_size: the MLP's inner width.
        num_hidden_layers: decoder layers.
    """

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_hidden_layers: int


def read_model_shape(path: str | Path) -> ModelShape:
    """The ``ModelShape`` in ``<path>/config.json`` (a Hugging Face config).

    Raises:
        FileNotFoundError: no ``config.json``.
        KeyError: a field is missing.
    """
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    heads = int(config["num_attention_heads"])
    return ModelShape(heads, int(config.get("num_key_value_heads") or heads), int(config["intermediate_size"]),
                      int(config["num_hidden_layers"]))


def check_parallel_sizes(shape, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """Refuses a parallel layout the model cannot be split into, before any rank starts.

    Args:
        shape: a ``ModelShape`` or a ``transformers`` config (the same attributes).

    Raises:
        ValueError: with the model's head counts and the sizes it allows.
    """
    t, p = tensor_parallel_size, pipeline_parallel_size
    if t < 1 or p < 1:
        raise ValueError(f"tensor- and pipeline-parallel sizes must be >= 1, got {t} and {p}")
    heads, kv = int(shape.num_attention_heads), int(shape.num_key_value_heads)
    inter = int(shape.intermediate_size)
    allowed = [n for n in range(1, heads + 1)
               if heads % n == 0 and inter % n == 0 and (kv % n == 0 or n % kv == 0)]
    if t not in allowed:
        raise ValueError(f"tensor-parallel size {t} does not split this model ({heads} attention heads, {kv} KV "
                         f"heads, intermediate_size {inter}); it must divide the attention heads and the "
                         f"intermediate size, and divide or be a multiple of the KV heads: one of "
                         f"{', '.join(map(str, allowed))}")
    layers = int(shape.num_hidden_layers)
    if p > layers:
        raise ValueError(f"pipeline-parallel size {p} exceeds the model's {layers} layers (one stage per layer "
                         "at most)")
