"""WorkerGroup: the one interface between the engine and whatever runs the model.

The engine owns requests, blocks and the step loop; it never touches weights or
tensors. Each step it hands the group a ``SchedulerOutput`` and gets a
``ModelRunnerOutput`` back, both plain picklable data, so a group may be one
worker in this process (``executor.worker.group.InProcessWorkerGroup``) or, later,
processes holding tensor- or pipeline-parallel shards behind the same calls::

    engine                                   worker group
    ──────                                   ────────────
    spec  ◀──────────────────────────────── model limits and KV shape (ModelSpec)
    initialize_cache(num_blocks, block_size) ──▶ allocate the paged K/V tensors
    execute_model(SchedulerOutput) ─────────▶ load fetched blocks, forward, sample,
                   ◀──── ModelRunnerOutput ── copy out blocks to publish
    shutdown() ─────────────────────────────▶ free the device

The lifecycle is fixed: ``spec`` may be read at once, ``initialize_cache`` is
called once before the first ``execute_model``, ``shutdown`` last.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from executor.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from meshserve.block_hash import KVLayout


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know of the model a worker group holds.

    Attributes:
        model_id: the model as served (``meshserve.model_files.ModelFiles.model_id``).
        revision: content fingerprint of its weights.
        dtype: parameter, activation and KV cache dtype name (``"float32"``,
            ``"bfloat16"``, ``"float16"``).
        num_layers: attention layers.
        num_kv_heads: KV heads per layer (of the whole model, before any sharding).
        head_dim: channels per head.
        vocab_size: number of token ids.
        max_model_len: longest sequence (prompt + output, tokens) supported.
        eos_token_ids: ids that end a generation unless ``ignore_eos``.
        num_params: parameters of the model (for the MFU estimate).
    """

    model_id: str
    revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_params: int

    def kv_layout(self, block_size: int) -> KVLayout:
        """The layout of one KV block of ``block_size`` tokens (its bytes: ``block_bytes``)."""
        return KVLayout(block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


class WorkerGroup(abc.ABC):
    """The model side of one executor, driven by the engine thread only."""

    @property
    @abc.abstractmethod
    def spec(self) -> ModelSpec:
        """The model's limits and KV shape (available right after construction)."""

    @abc.abstractmethod
    def initialize_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocates ``num_blocks`` KV blocks of ``block_size`` tokens on every worker.

        Raises:
            RuntimeError: the device cannot hold them (out of memory).
        """

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: drops the state of ``finished_request_ids``, copies
        ``kv_loads`` into the cache, runs the forward pass over ``scheduled``, samples
        the requests whose ``sample`` is set, and copies out ``kv_saves``.

        An empty step (nothing scheduled) only drops finished requests' state.
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Releases the workers (idempotent); no call may follow."""
