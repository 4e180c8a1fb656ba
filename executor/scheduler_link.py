"""The executor's link to the scheduler.

``SchedulerLink`` keeps one ``Connect`` stream to the scheduler open: Register,
a snapshot of the prefix cache (``KvEvents`` with ``reset``), then a capacity
report (with the blocks each lease's requests hold) whenever the engine's state
changes and the prefix cache's net changes (``executor.kv_events``), batched
at most every ``report_interval_s``; it reconnects with back-off if the
scheduler goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc

from executor.engine.async_engine import AsyncEngine
from executor.kv_events import KvEventBatcher
from meshserve.background import BackgroundTask
from meshserve.grpc_server import CHANNEL_OPTIONS, open_channel
from meshserve.lease_token import LeaseVerifier
from meshserve.timeouts import wait_for
from meshserve.tls import PLAINTEXT, TLSConfig
from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class LinkedServicer(Protocol):
    """What the link reads of the executor's servicer (``executor.server.ExecutorServicer``)."""

    engine: AsyncEngine
    model_id: str
    leases: LeaseVerifier  # takes the scheduler's lease key from its RegisterAck
    active_leases: dict[str, str]  # scoped request id -> lease id of the Execute calls in flight


@dataclass
class LinkConfig:
    """How an executor presents itself to the scheduler."""

    scheduler_address: str
    executor_id: str
    advertise_address: str
    pool: str = "default"
    report_interval_s: float = 0.05
    heartbeat_s: float = 1.0  # a report at least this often, changed or not (the scheduler drops silent executors)
    max_hashes_per_message: int = 8192  # 16 bytes each: 128 KiB messages
    tls: TLSConfig = PLAINTEXT  # the executor's certificate (role executor), or plaintext
    started_at: float | None = None  # time.monotonic() when the process began (cold start = register - this)


def lease_num_blocks(num_blocks_by_request: Mapping[str, int], active_leases: dict[str, str]) -> dict[str, int]:
    """Blocks held per lease: the requests' blocks mapped to their leases.

    Args:
        num_blocks_by_request: request id → blocks it holds, all its choices together
            (``AsyncEngine.num_blocks_by_request``).
        active_leases: request id → lease id of the Execute calls in flight.

    Returns:
        lease id → blocks of all its requests; leases holding none are absent.
    """
    out: dict[str, int] = {}
    for rid, blocks in num_blocks_by_request.items():
        lease = active_leases.get(rid)
        if lease:
            out[lease] = out.get(lease, 0) + blocks
    return out


class SchedulerLink(BackgroundTask):
    """Keeps the executor registered with the scheduler over one Connect stream."""

    def __init__(self, config: LinkConfig, servicer: LinkedServicer):
        self.config = config
        self.servicer = servicer
        self.connected = asyncio.Event()
        self.kv_events = KvEventBatcher()
        self._wake = asyncio.Event()
        self.draining_grace_s: float | None = None  # set by ``begin_drain`` (executor.drain)
        self.drain_acked = asyncio.Event()  # the scheduler routes nothing new here
        self.drained = asyncio.Event()  # the scheduler holds no lease of ours: we may leave

    def notify(self) -> None:
        """Asks for a capacity report soon (called when the engine state changes)."""
        self._wake.set()

    def begin_drain(self, grace_s: float) -> None:
        """Tells the scheduler (now, and again after a reconnection) that this executor drains."""
        self.draining_grace_s = grace_s
        self._wake.set()

    def on_kv_events(self, events: list) -> None:
        """Takes the engine's prefix-cache events (in the event loop) for the next batch."""
        self.kv_events.add(events)
        self._wake.set()

    async def stop(self) -> None:
        await super().stop()
        self.connected.clear()  # a later start() waits for a fresh registration

    def _register(self) -> scheduler_pb2.ExecutorMessage:
        eng = self.servicer.engine.engine
        return scheduler_pb2.ExecutorMessage(
            register=scheduler_pb2.ExecutorRegister(
                executor_id=self.config.executor_id,
                address=self.config.advertise_address,
                model=self.servicer.model_id,
                num_blocks=eng.num_blocks,
                block_size=eng.block_size,
                max_model_len=eng.max_model_len,
                pool=self.config.pool,
                kvstore_namespace=(eng.kv_store_fingerprint.namespace if eng.kv_connector is not None else b""),
                startup_s=(time.monotonic() - self.config.started_at) if self.config.started_at is not None else 0.0,
            )
        )

    def _report(self) -> scheduler_pb2.ExecutorMessage:
        s = self.servicer.engine.stats()
        return scheduler_pb2.ExecutorMessage(
            capacity=scheduler_pb2.CapacityReport(
                num_free_blocks=s.num_free_blocks,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                lease_ids=[lease for lease in self.servicer.active_leases.values() if lease],
                lease_num_blocks=lease_num_blocks(self.servicer.engine.num_blocks_by_request(s),
                                                  self.servicer.active_leases),
            )
        )

    def _kv_messages(self, stored: list[bytes], removed: list[bytes], reset: bool = False):
        """``KvEvents`` messages of at most ``max_hashes_per_message`` hashes; ``reset`` on the first."""
        step = self.config.max_hashes_per_message
        for i in range(0, max(1, len(removed)), step):
            if removed[i:i + step] or reset:
                yield scheduler_pb2.ExecutorMessage(kv_events=scheduler_pb2.KvEvents(reset=reset,
                                                                                     removed=removed[i:i + step]))
                reset = False
        for i in range(0, len(stored), step):
            yield scheduler_pb2.ExecutorMessage(kv_events=scheduler_pb2.KvEvents(stored=stored[i:i + step]))

    async def _messages(self):
        yield self._register()
        for msg in self._kv_messages(self.kv_events.snapshot(), [], reset=True):
            yield msg
        drain_sent = False
        while True:
            if self.draining_grace_s is not None and not drain_sent:
                drain_sent = True
                yield scheduler_pb2.ExecutorMessage(
                    draining=scheduler_pb2.ExecutorDraining(grace_s=self.draining_grace_s))
            if self.kv_events.pending():
                for msg in self._kv_messages(*self.kv_events.take()):
                    yield msg
            yield self._report()
            try:
                await wait_for(self._wake.wait(), self.config.heartbeat_s)
            except asyncio.TimeoutError:
                continue  # heartbeat: the same report again
            self._wake.clear()
            await asyncio.sleep(self.config.report_interval_s)

    def _take_lease_key(self, raw: bytes) -> None:
        """Takes the scheduler's lease key from its RegisterAck (without one, or with a
        malformed one, every Execute is refused: PERMISSION_DENIED)."""
        try:
            self.servicer.leases.set_public_key(raw)
        except ValueError as exc:
            log.error("the scheduler sent no usable lease key (%s): every Execute will be refused", exc)

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            try:
                async with open_channel(self.config.scheduler_address, self.config.tls, CHANNEL_OPTIONS) as ch:
                    stub = scheduler_pb2_grpc.SchedulerStub(ch)
                    async for cmd in stub.Connect(self._messages()):
                        kind = cmd.WhichOneof("kind")
                        if kind == "registered":
                            self._take_lease_key(cmd.registered.lease_public_key)
                            log.info("registered with the scheduler as %s", cmd.registered.executor_id)
                            self.connected.set()
                            backoff = 0.2
                        elif kind == "drain_ack":
                            (self.drained if cmd.drain_ack.done else self.drain_acked).set()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning("scheduler link lost (%s); retrying in %.1f s", exc.code().name, backoff)
            self.connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
