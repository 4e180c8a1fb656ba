"""Loads a resolved model folder into our own model.

The folder is what ``meshserve.model_files.resolve_model`` returns: ``config.json``
(read with ``transformers.AutoConfig``), ``*.safetensors`` weights (read with
``safetensors``, one tensor at a time and only the part this tensor-parallel
rank holds: ``executor.models.checkpoint``; converted to the model dtype while copied),
and optionally ``generation_config.json`` (for EOS ids).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from executor.attention import get_backend
from executor.models import model_class
from executor.models.checkpoint import iter_checkpoint
from executor.models.cpu_dtype import choose_cpu_dtype
from executor.models.parallel import SINGLE, PipelineStage, TensorParallel
from executor.parallel_layout import check_parallel_sizes  # noqa: F401 - re-exported: checked at load too
from meshserve.model_files import eos_token_ids

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run, with the limits the engine needs.

    Attributes:
        model: our module (``forward(input_ids, positions, metadata)``, ``compute_logits``).
        hf_config: the ``transformers`` config it was built from.
        dtype: parameter and activation dtype.
        max_model_len: longest sequence (prompt + output, tokens) supported.
        vocab_size: number of token ids.
        eos_token_ids: ids that end a generation unless ``ignore_eos``.
    """

    model: nn.Module
    hf_config: object
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """``"auto"``: on CPU the faster of float32 and bfloat16 on this CPU for this model's
    sizes (``executor/models/cpu_dtype.py``: float32 without native bfloat16, else a
    measured matmul probe; the choice and its reason are logged); on an accelerator
    the checkpoint's 16-bit dtype, else bfloat16.

    Raises:
        ValueError: an unknown dtype name.
    """
    if name == "auto":
        if device.type == "cpu":
            return choose_cpu_dtype(int(hf_config.hidden_size), int(hf_config.intermediate_size)).dtype
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def derive_max_model_len(hf_config, requested: int | None) -> int:
    """The model's context limit: ``max_position_embeddings``, capped at
    ``sliding_window`` when the config has one (attention is then never windowed),
    and at ``requested`` when given.

    Raises:
        ValueError: ``requested`` exceeds the model's limit or is < 2.
    """
    limit = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    if window:
        limit = min(limit, int(window))
    if requested is None:
        return limit
    if not 2 <= requested <= limit:
        raise ValueError(f"max_model_len must be in [2, {limit}] for this model, got {requested}")
    return requested


def load_model(path: str | Path, *, dtype: str = "auto", max_model_len: int | None = None,
               attention_backend: str = "torch", device: str | torch.device = "cpu",
               tp: TensorParallel = SINGLE, pack_weights: bool = True, pp_rank: int = 0,
               pp_size: int = 1) -> LoadedModel:
    """Builds our model for the folder's config and loads its weights (only tensor-parallel
    rank ``tp.rank``'s shard of pipeline stage ``pp_rank`` of ``pp_size``: its layers, and
    the embedding, final norm and LM head on stage 0).

    ``pack_weights``: on CPU, also keep each linear weight packed for oneDNN
    (``executor/models/cpu_gemm.py``): faster decode steps and batch-invariant
    matmuls, for the weights' size once more in memory.

    Raises:
        ValueError: unsupported architecture, rope type, activation or dtype; a bad
            ``max_model_len``; weights missing from the checkpoint.
        KeyError: a checkpoint tensor our model has no place for.
        FileNotFoundError: no config or weights.
    """
    from transformers import AutoConfig

    path, device = Path(path), torch.device(device)
    hf_config = AutoConfig.from_pretrained(path)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    limit = derive_max_model_len(hf_config, max_model_len)
    cls = model_class(hf_config)
    if tp.world_size > 1 or pp_size > 1:
        check_parallel_sizes(hf_config, tp.world_size, pp_size)
    stage = PipelineStage(pp_rank, pp_size, int(hf_config.num_hidden_layers))
    model = cls(hf_config, get_backend(attention_backend), max_positions=limit, tp=tp, dtype=torch_dtype, pp=stage)
    loaded = model.load_weights(iter_checkpoint(path))  # each rank reads only its shard
    expected = {n for n, _ in model.named_parameters()}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for {missing[:5]}{'…' if len(missing) > 5 else ''}")
    model = model.to(device).eval()
    if pack_weights:
        model.process_weights_after_loading()
    log.info("loaded %s (%s, %s) max_model_len=%d", path, cls.__name__, torch_dtype, limit)
    return LoadedModel(model, hf_config, torch_dtype, limit, int(hf_config.vocab_size), eos_token_ids(path, hf_config))
