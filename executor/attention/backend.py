"""The attention backend interface and its registry by name.

A backend does two things per step: ``plan`` (once, after the ModelRunner built
the ``AttentionMetadata``: precompute gather indices, masks, kernel work lists)
and ``forward`` (once per layer: write this step's K/V into the paged cache, then
attend). Backends: ``torch`` (a reference in plain PyTorch, used on CPU) and
``triton`` (paged-attention kernels for CUDA, registered only where triton is
installed); ``resolve_backend_name("auto", device)`` picks between them.
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from executor.attention.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's ``(key_cache, value_cache)``, each ``(num_blocks, block_size,
num_kv_heads, head_dim)`` in the model's dtype."""


class AttentionBackend(ABC):
    """Paged causal attention over a flattened, unpadded batch."""

    name: ClassVar[str]

    def plan(self, metadata: AttentionMetadata) -> None:
        """Precomputes per-step data into ``metadata.plan`` (default: nothing)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Writes ``k``/``v`` into ``kv_cache`` at ``metadata.slot_mapping`` and attends.

        Args:
            q: ``(num_tokens, num_heads, head_dim)``.
            k, v: ``(num_tokens, num_kv_heads, head_dim)``; ``num_heads`` must be a
                multiple of ``num_kv_heads`` (grouped-query attention).
            kv_cache: this layer's paged cache (written in place).
            metadata: the step's metadata, after ``plan``.
            scale: softmax scale (usually ``head_dim ** -0.5``).

        Returns:
            ``(num_tokens, num_heads, head_dim)``, the dtype of ``q``.
        """


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: makes a backend available to ``get_backend(name)``."""

    def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def _import_backends() -> None:
    """Imports the backend modules so they register: ``torch`` always, ``triton`` when
    triton is installed (the project runs without it). Registering ``triton`` does not
    import triton itself; constructing the backend does."""
    import executor.attention.torch_backend  # noqa: F401 - registers "torch"

    if importlib.util.find_spec("triton") is not None:
        import executor.attention.triton_backend  # noqa: F401 - registers "triton"


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_backend(name: str) -> AttentionBackend:
    """A new instance of the backend registered as ``name``.

    Raises:
        ValueError: no backend of that name.
    """
    _import_backends()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


def available_backends() -> list[str]:
    """Names of the registered backends."""
    _import_backends()
    return sorted(_REGISTRY)


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """The backend to use for ``name`` on ``device``.

    ``"auto"`` is ``"triton"`` on a CUDA device when triton imports, else ``"torch"``;
    any other name is returned unchanged once checked.

    Raises:
        ValueError: ``name`` is neither ``"auto"`` nor a registered backend, or it is
            ``"triton"`` on a non-CUDA device outside Triton's interpreter
            (``TRITON_INTERPRET=1``), where its kernels cannot run.
    """
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" and _triton_importable() else "torch"
    if name not in available_backends():
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(available_backends())}")
    if name == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device, not {torch.device(device).type!r} "
            "(set TRITON_INTERPRET=1 to run its kernels in Triton's interpreter, for tests); use 'torch' or 'auto'"
        )
    return name
