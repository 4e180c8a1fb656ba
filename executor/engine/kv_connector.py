"""The engine's side of sharing prefix KV with other executors.

``KVConnector`` is the small interface the engine thread calls; it never blocks
that thread: fetches and publishes run elsewhere (``executor.kvstore_connector``
runs them on its own I/O thread over gRPC) and their results are *polled* by
the engine between steps. The design follows vLLM's KV connector
(``WAITING_FOR_REMOTE_KVS``, load before the forward pass, save after) and
LMCache's lookup/retrieve/store split::

    engine thread                                   connector I/O
    ─────────────                                   ─────────────
    add_request: local prefix hit stops before
      the last full block → start_fetch(hashes) ──▶ Get(longest stored prefix)
      request waits in WAITING_FOR_REMOTE_KVS        verify checksums
    step(): poll() ◀──────────────────────────────── FetchResult (payloads or none)
      → waiting with ExternalKV; scheduled:
      payloads copied into new blocks, prefill skipped
    after a step: newly cached full blocks
      cloned (one gather) → publish(...) ──────────▶ Put (bounded queue, drops when full)
    abort: cancel(request_id) ─────────────────────▶ cancels the Get: leases released

A fetch that fails, returns fewer blocks, carries a corrupt block or misses its
deadline only shortens (or empties) the loaded prefix: the rest is recomputed,
so the output is the same as a cold run's.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from meshserve.block_hash import BlockHash, KVStoreFingerprint


@dataclass(frozen=True)
class FetchResult:
    """A finished fetch.

    Attributes:
        request_id: the engine request it was for.
        start_block: logical index of the first requested block.
        payloads: verified payloads of the leading blocks found, in order (raw bytes
            of ``(num_layers, 2, block_size, num_kv_heads, head_dim)`` in the cache
            dtype); may be empty.
        num_requested: blocks asked for.
    """

    request_id: str
    start_block: int
    payloads: list
    num_requested: int


@dataclass(frozen=True)
class KVConnectorStats:
    """Counters of a connector (a snapshot).

    Attributes:
        fetches: fetches finished (any outcome).
        fetched_blocks: blocks received and verified.
        bytes_in: payload bytes received (verified or not).
        fetch_failures: fetches that ended on an error (unreachable store, failed
            call), a corrupt block, or their deadline (given up by the engine).
        corrupt_blocks: blocks whose checksum did not match.
        fetch_seconds: total seconds from start to finish of the finished fetches.
        published_blocks: blocks the store acknowledged (stored or already there).
        bytes_out: payload bytes sent by publishes.
        publish_dropped_blocks: blocks not published because the queue was full,
            or because the Put failed.
    """

    fetches: int = 0
    fetched_blocks: int = 0
    bytes_in: int = 0
    fetch_failures: int = 0
    corrupt_blocks: int = 0
    fetch_seconds: float = 0.0
    published_blocks: int = 0
    bytes_out: int = 0
    publish_dropped_blocks: int = 0


class KVConnector(abc.ABC):
    """What the engine needs from a shared KV store. Every method is called from the
    engine thread and returns at once.

    Attributes:
        fingerprint: model and layout of the payloads (the store's namespace).
        fetch_timeout_s: seconds the engine waits for a fetch before recomputing.
    """

    fingerprint: KVStoreFingerprint
    fetch_timeout_s: float

    @abc.abstractmethod
    def start_fetch(self, request_id: str, start_block: int, block_hashes: Sequence[BlockHash],
                    trace_context: object = None) -> None:
        """Starts fetching the longest stored prefix of ``block_hashes`` (the request's
        blocks ``start_block ..``); its ``FetchResult`` comes out of ``poll``."""

    @abc.abstractmethod
    def poll(self) -> list[FetchResult]:
        """Fetches finished since the last call (cancelled ones never appear)."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Abandons the request's fetch, if any (its leases are released)."""

    @abc.abstractmethod
    def publish(self, blocks: Sequence[tuple[BlockHash, torch.Tensor]], trace_context: object = None) -> None:
        """Sends computed full blocks to the store in the background.

        Args:
            blocks: ``(chain hash, kv)`` with ``kv`` a private CPU copy of shape
                ``(num_layers, 2, block_size, num_kv_heads, head_dim)`` in the cache dtype.
        """

    @abc.abstractmethod
    def is_known(self, block_hash: BlockHash) -> bool:
        """Whether the block was recently fetched or published (no need to publish it)."""

    @abc.abstractmethod
    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called (from any thread) when a fetch finishes."""

    @abc.abstractmethod
    def stats(self) -> KVConnectorStats:
        """The counters so far."""

    @abc.abstractmethod
    def note_fetch_given_up(self) -> None:
        """Counts a fetch the engine stopped waiting for (deadline)."""
