"""KV transfer between executors through a shared store: the engine's half.

Three pieces, as vLLM v1's KV connector splits them (a scheduler-side half that
decides, a worker-side half that moves bytes) plus the I/O to the store:

* ``KVConnector`` (this module's ABC; ``executor.kvstore_connector`` implements it
  over gRPC): fetches and publishes on its own I/O thread, never blocking the
  engine thread, which *polls* its results between steps;
* ``KVConnectorScheduler`` (here): the scheduler's half. It owns each request's
  fetch state (in flight with a deadline, or fetched payloads waiting to be
  loaded) and decides which blocks to fetch (at admission), to load (when the
  request is scheduled) and to publish (full blocks a step computes). The batch
  scheduler calls it at fixed points; its decisions travel to the worker in the
  step's ``SchedulerOutput`` (``kv_loads``, ``kv_saves``);
* ``executor.worker.kv_connector.KVConnectorWorker``: the worker's half, copying
  those blocks' bytes into the KV cache before the forward pass and out of it
  after (``ModelRunnerOutput.kv_saved``).

::

    batch scheduler                 scheduler half                 connector I/O
    ───────────────                 ──────────────                 ─────────────
    add_request ──────────────────▶ start_fetch: local hit stops
                                    before the last full block ──▶ Get(longest stored prefix)
      request WAITING_FOR_REMOTE_KVS                                 verify checksums
    schedule(): ◀────────────────── finished_fetches ◀──────────── poll(): FetchResult
      → waiting; when scheduled:    num_loadable_blocks,
      new blocks, prefill skipped   update_state_after_alloc
                                    build_connector_meta ──▶ SchedulerOutput.kv_loads / kv_saves
    update_from_output ───────────▶ publish(kv_saved) ───────────▶ Put (bounded queue, drops when full)
    abort / finish ───────────────▶ request_finished ────────────▶ cancel the Get: leases released

A fetch that fails, returns fewer blocks, carries a corrupt block or misses its
deadline only shortens (or empties) the loaded prefix: the rest is recomputed,
so the output is the same as a cold run's. Blocks are named by their chain hash
(``meshserve.block_hash``, the KV cache manager's), the same as in the engine's
prefix cache, so nothing is re-hashed for the store.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from executor.engine.kv_cache_manager import KVCacheManager
from executor.engine.outputs import KVConnectorStats
from executor.engine.request import Request
from executor.engine.scheduler_output import BlockSave, ModelRunnerOutput, SchedulerOutput
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


class KVConnector(abc.ABC):
    """The I/O to a shared KV store. Every method is called from the engine thread
    and returns at once.

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
    def publish(self, blocks: Sequence[tuple[BlockHash, bytes]], trace_context: object = None) -> None:
        """Sends computed full blocks to the store in the background.

        Args:
            blocks: ``(chain hash, payload)``, the payload the raw bytes of one
                ``(num_layers, 2, block_size, num_kv_heads, head_dim)`` tensor in the
                cache dtype (``executor.worker.kv_connector``).
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


def usable_payloads(start_block: int, payloads: list, num_hit_blocks: int, max_blocks: int) -> list:
    """Fetched payloads of the blocks right after a local prefix hit.

    Args:
        start_block: logical index of the first fetched block.
        payloads: the fetched blocks' payloads, in order.
        num_hit_blocks: blocks of the request's local prefix hit.
        max_blocks: blocks of hits the request may have at most (its last token is
            always computed, like after a local hit).

    Returns:
        The payloads of blocks ``num_hit_blocks .. max_blocks - 1`` that were
        fetched; empty when the fetched run starts after the local hit (a gap
        would leave blocks uncomputed).
    """
    if start_block > num_hit_blocks:
        return []
    return payloads[num_hit_blocks - start_block:max(0, max_blocks - start_block)]


@dataclass
class _Fetch:
    """One request's fetch: in flight until ``payloads`` is set (empty: failed or late)."""

    start_block: int
    deadline: float
    payloads: list | None = None


class KVConnectorScheduler:
    """The scheduler's half of KV transfer (see the module doc); engine thread only.

    Args:
        connector: the I/O to the store (its ``fetch_timeout_s`` is read at each fetch).
        kv_cache_manager: the requests' blocks and chain hashes (read only).
    """

    def __init__(self, connector: KVConnector, kv_cache_manager: KVCacheManager):
        self.connector = connector
        self.kv = kv_cache_manager
        self._fetches: dict[str, _Fetch] = {}
        self._loads: dict[str, list[tuple[int, bytes | bytearray]]] = {}  # request id -> (block_id, payload)
        # of the step being scheduled

    # -- fetch ----------------------------------------------------------------

    def start_fetch(self, request: Request, now: float) -> int:
        """Starts fetching the request's full prompt blocks after its local prefix hit,
        up to the block before its last token (when it has no prompt logprobs,
        which need every position computed).

        Args:
            now: the batch scheduler's clock (monotonic seconds); the fetch is given
                up at ``now + connector.fetch_timeout_s``.

        Returns:
            Blocks asked of the store; 0 when there is nothing to fetch (no fetch started).
        """
        if not self.kv.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return 0
        hits, _ = self.kv.get_computed_blocks(request)
        max_blocks = self._max_hit_blocks(request)
        if len(hits) >= max_blocks:
            return 0
        hashes = self.kv.block_hashes(request)[len(hits):max_blocks]
        self._fetches[request.request_id] = _Fetch(len(hits), now + self.connector.fetch_timeout_s)
        self.connector.start_fetch(request.request_id, len(hits), hashes, request.trace_context)
        return len(hashes)

    def finished_fetches(self, now: float) -> list[str]:
        """Requests whose fetch ended since the last call: finished (their payloads
        wait for ``update_state_after_alloc``) or past their deadline (cancelled and
        counted as a failure: they recompute). Late completions are ignored."""
        ended = [result.request_id for result in self.connector.poll() if self.on_fetch_result(result)]
        for request_id, fetch in self._fetches.items():
            if fetch.payloads is None and fetch.deadline <= now:
                self.connector.cancel(request_id)
                self.connector.note_fetch_given_up()
                fetch.payloads = []
                ended.append(request_id)
        return ended

    def on_fetch_result(self, result: FetchResult) -> bool:
        """Keeps a finished fetch's payloads; False (ignored) when the request is not
        fetching any more (aborted, or given up at its deadline): a late completion."""
        fetch = self._fetches.get(result.request_id)
        if fetch is None or fetch.payloads is not None:
            return False
        fetch.payloads = list(result.payloads)
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline of the fetches in flight (None: none in flight)."""
        return min((f.deadline for f in self._fetches.values() if f.payloads is None), default=None)

    # -- load -----------------------------------------------------------------

    def num_loadable_blocks(self, request: Request, num_hit_blocks: int) -> int:
        """Blocks of fetched payloads that extend the request's local prefix hit of
        ``num_hit_blocks`` blocks (vLLM's ``get_num_new_matched_tokens``, in blocks)."""
        return len(self._usable(request, num_hit_blocks))

    def update_state_after_alloc(self, request: Request, num_hit_blocks: int, new_block_ids: list[int]) -> None:
        """The request was scheduled with ``new_block_ids`` after its local hit: the
        first of them receive its loadable payloads this step; its fetch state ends."""
        loads = list(zip(new_block_ids, self._usable(request, num_hit_blocks)))
        if loads:
            self._loads[request.request_id] = loads
        self._fetches.pop(request.request_id, None)

    def discard_loads(self, request_id: str) -> int:
        """Drops the loads ``update_state_after_alloc`` recorded for a request this
        step (it was preempted before the step ran: its blocks are free again);
        returns how many blocks it had."""
        return len(self._loads.pop(request_id, ()))

    def _usable(self, request: Request, num_hit_blocks: int) -> list:
        fetch = self._fetches.get(request.request_id)
        if fetch is None or not fetch.payloads:
            return []
        return usable_payloads(fetch.start_block, fetch.payloads, num_hit_blocks, self._max_hit_blocks(request))

    def _max_hit_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.kv.block_size

    # -- the step -------------------------------------------------------------

    def build_connector_meta(self, scheduled: Sequence[tuple[Request, int]]
                             ) -> tuple[list[tuple[int, bytes | bytearray]], list[BlockSave]]:
        """This step's ``(kv_loads, kv_saves)`` for its ``SchedulerOutput``.

        Args:
            scheduled: each scheduled request with its tokens this step (before
                ``num_computed_tokens`` advances).

        Returns:
            The loads recorded by ``update_state_after_alloc`` for requests still
            scheduled (a request preempted since holds none of its blocks), and the full blocks
            this step completes whose hash neither the prefix cache nor the store
            (as far as the connector knows) holds yet, each once.
        """
        loads = [load for request, _ in scheduled for load in self._loads.get(request.request_id, ())]
        self._loads = {}
        if not self.kv.enable_caching:
            return loads, []
        saves: list[BlockSave] = []
        seen: set[BlockHash] = set()
        bs = self.kv.block_size
        for request, num_new in scheduled:
            first, end = request.num_computed_tokens // bs, (request.num_computed_tokens + num_new) // bs
            if end <= first:
                continue
            hashes, block_ids = self.kv.block_hashes(request), self.kv.req_to_blocks[request.request_id]
            for i in range(first, end):
                h = hashes[i]
                if h in seen or self.kv.block_pool.get_cached_block(h) is not None or self.connector.is_known(h):
                    continue
                seen.add(h)
                saves.append(BlockSave(block_ids[i], h, request.request_id))
        return loads, saves

    def publish(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                requests: Mapping[str, Request]) -> None:
        """Hands the step's saved blocks to the store, one publish per request (its
        trace parents the publish span)."""
        by_request: dict[str, list[tuple[BlockHash, bytes]]] = {}
        for save, payload in zip(scheduler_output.kv_saves, runner_output.kv_saved):
            by_request.setdefault(save.request_id, []).append((save.block_hash, payload))
        for request_id, blocks in by_request.items():
            request = requests.get(request_id)
            self.connector.publish(blocks, request.trace_context if request is not None else None)

    def request_finished(self, request_id: str) -> None:
        """Drops the request's fetch state; a fetch in flight is cancelled (its leases released)."""
        fetch = self._fetches.pop(request_id, None)
        if fetch is not None and fetch.payloads is None:
            self.connector.cancel(request_id)
