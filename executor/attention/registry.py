"""The attention backends by name: ``torch`` always, ``triton`` where triton is installed.

The registry imports its plug-ins, never the other way round: ``torch_backend``
(a reference in plain PyTorch, used on CPU) and ``triton_backend`` (paged-attention
kernels for CUDA; importing it does not import triton itself, constructing the
backend does, so the project runs without triton). ``resolve_backend_name("auto",
device)`` picks between them.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from executor.attention.backend import AttentionBackend
from executor.attention.torch_backend import TorchAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}
if importlib.util.find_spec("triton") is not None:
    from executor.attention.triton_backend import TritonAttentionBackend

    _BACKENDS[TritonAttentionBackend.name] = TritonAttentionBackend


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401 - only asked by "auto" on a CUDA device
    except ImportError:
        return False
    return True


def get_backend(name: str) -> AttentionBackend:
    """A new instance of the backend registered as ``name``.

    Raises:
        ValueError: no backend of that name.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()


def available_backends() -> list[str]:
    """Names of the registered backends."""
    return sorted(_BACKENDS)


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
