"""Checkpoint tensors read lazily, so a tensor-parallel rank reads only its shard.

``iter_checkpoint(path)`` yields ``(name, CheckpointTensor)`` for every tensor of a
safetensors folder without reading any data. A ``CheckpointTensor`` looks like
the parts of a ``torch.Tensor`` the layers' ``weight_loader``s use (``shape``,
``dim()``, ``narrow``, slicing with ``[a:b]``); each of those reads from the
file only the rows or columns asked for (safetensors' ``get_slice``), so
``QKVParallelLinear`` on rank 1 of 3 reads the third of ``q_proj`` it holds and
nothing else. ``materialize`` turns either kind into a real tensor.

``ReadCounter`` counts the elements read, for the test that each rank reads only
its shard. ``attach_weight_loader`` gives a parameter its layer's loader.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn


def attach_weight_loader(param: nn.Parameter, layer: nn.Module) -> None:
    """Sets ``param.weight_loader`` to call ``layer.weight_loader(param, loaded, shard_id=None)``
    through a weak reference to ``layer``.

    A plain bound method (``param.weight_loader = self.weight_loader``, as vLLM writes
    it) is a reference cycle: layer -> parameter -> method -> layer. Only Python's
    cyclic collector frees a cycle, and it runs by object counts, which a model of few,
    large tensors barely moves: a dropped model's weights (hundreds of MB) stayed in
    memory until a full collection happened to run. With the weak reference a model is
    freed as soon as its last reference goes.

    Raises (when called):
        ReferenceError: ``layer`` no longer exists.
    """
    method, kind = weakref.WeakMethod(layer.weight_loader), type(layer).__name__  # nothing holds ``layer`` itself

    def weight_loader(target: nn.Parameter, loaded, shard_id: object = None) -> None:
        bound = method()
        if bound is None:
            raise ReferenceError(f"the {kind} owning this parameter no longer exists")
        bound(target, loaded, shard_id)

    param.weight_loader = weight_loader


@dataclass
class ReadCounter:
    """Elements read from checkpoint files through ``CheckpointTensor``s."""

    elements: int = 0


class CheckpointTensor:
    """One tensor of a safetensors file, read on demand.

    Args:
        handle: the open ``safetensors.safe_open`` file.
        name: the tensor's name in it.
        counter: where to add the elements read (optional).
        index: the slice of the file's tensor this object stands for (internal:
            ``narrow`` and ``[a:b]`` return narrower views without reading).
    """

    def __init__(self, handle, name: str, counter: ReadCounter | None = None,
                 index: tuple[slice, ...] | None = None):
        self._handle = handle
        self._name = name
        self._counter = counter
        full = tuple(handle.get_slice(name).get_shape())
        self._index = index if index is not None else tuple(slice(0, n) for n in full)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._index)

    def dim(self) -> int:
        return len(self._index)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """The view of ``length`` entries from ``start`` along ``dim`` (nothing read yet).

        Raises:
            IndexError: the range leaves the tensor.
        """
        base = self._index[dim]
        if start < 0 or length < 0 or base.start + start + length > base.stop:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}")
        index = list(self._index)
        index[dim] = slice(base.start + start, base.start + start + length)
        return CheckpointTensor(self._handle, self._name, self._counter, tuple(index))

    def __getitem__(self, item: slice) -> CheckpointTensor:
        """``t[a:b]``: rows ``a`` to ``b`` (clipped like a tensor slice; step 1 only)."""
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError("a CheckpointTensor takes only t[a:b] slices of its first dimension")
        start, stop, _ = item.indices(self.shape[0])
        return self.narrow(0, start, max(0, stop - start))

    def read(self) -> torch.Tensor:
        """Reads the viewed part from the file (a new tensor in the file's dtype)."""
        tensor = self._handle.get_slice(self._name)[self._index]
        if self._counter is not None:
            self._counter.elements += tensor.numel()
        return tensor


def materialize(loaded: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    """``loaded`` as a tensor (reads a ``CheckpointTensor``'s part now)."""
    return loaded.read() if isinstance(loaded, CheckpointTensor) else loaded


def iter_checkpoint(path: Path, counter: ReadCounter | None = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yields ``(name, CheckpointTensor)`` for every tensor of every ``*.safetensors``
    file in ``path``, reading no data (each file stays open while its tensors are used).

    Raises:
        FileNotFoundError: the folder has no safetensors file.
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, CheckpointTensor(handle, name, counter)


def checkpoint_num_params(path: Path, tied: bool) -> int:
    """Parameters of the whole model, counted from the checkpoint's shapes (no data
    read): what a rank holding a shard reports for the MFU estimate. A tied
    ``lm_head.weight`` and rotary buffers are not counted."""
    total = 0
    for name, tensor in iter_checkpoint(path):
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        total += tensor.shape.numel()
    return total
