"""Durable callback deliveries on a real redis-server, without a model: two runners
(two gateways) with real ``CallbackDelivery`` senders share one store; a receiver
holds the first POST while the gateway sending it dies (or stops). The other
gateway takes the pending delivery over once its lease lapses (a fake clock) and
delivers it exactly once more, with the same body and a valid signature; the dead
deliverer's late writes are refused."""

from __future__ import annotations

import asyncio

import pytest

from gateway.callback_delivery import CallbackDelivery
from gateway.callbacks import CallbackPolicy, CallbackSender, verify
from gateway.redis_task_store import RedisTaskStore
from gateway.task_api import to_status
from gateway.task_runner import TaskRunner
from gateway.task_store import TaskRecord, TaskState
from meshserve.v1 import gateway_pb2
from tests.support.http_receiver import Receiver

LEASE_S = 10.0
SECRET = b"takeover-secret"


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Gateway:
    """One runner whose final transitions deliver callbacks to the receiver."""

    def __init__(self, url: str, clock: FakeClock, name: str, receiver: Receiver):
        self.store = RedisTaskStore(url, ttl_s=600)
        sender = CallbackSender(CallbackPolicy([receiver.url]), SECRET, max_attempts=3, backoff_s=0.001)
        self.runner = TaskRunner(self.store, clock, heartbeat_s=0.02, owner=name, lease_s=LEASE_S,
                                 claim_poll_s=0.02, resume=self._resume)
        self.runner.on_final = CallbackDelivery(self.store, sender, name, to_status)

    def _resume(self, record: TaskRecord):
        raise AssertionError(f"no task is taken over here: {record}")

    def crash(self) -> None:
        """SIGKILL: loops and deliveries stop where they are; nothing more is written."""
        self.runner._closing = True
        for task in [*self.runner._loops, *self.runner._finals]:
            task.cancel()


@pytest.fixture
async def receiver():
    r = await Receiver().start()
    yield r
    await r.stop()


@pytest.fixture
async def pair(redis_url, receiver):
    clock = FakeClock()
    a, b = Gateway(redis_url, clock, "gw-a", receiver), Gateway(redis_url, clock, "gw-b", receiver)
    await a.store._redis.flushdb()
    yield a, b, clock
    for gw in (a, b):
        await gw.runner.close()
        await gw.store.close()


async def succeeded(hooks) -> bytes:
    await hooks()
    return gateway_pb2.TaskStatus(choices=[gateway_pb2.TaskChoice(text="hi", token_ids=[7, 8])]).SerializeToString()


def with_callback(task_id: str, receiver: Receiver) -> TaskRecord:
    return TaskRecord(task_id, "acme", request_id=task_id, created_at=1.0, callback_url=f"{receiver.url}/hooks/done",
                      callback_state="pending")


async def callback_settled(store, task_id: str) -> TaskRecord:
    """The record once its callback is no longer pending (polled; the bound only catches a hang)."""
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        record = await store.get(task_id)
        if record is not None and record.callback_state in ("delivered", "failed"):
            return record
        assert asyncio.get_running_loop().time() < deadline, record
        await asyncio.sleep(0.01)


async def test_a_delivery_whose_gateway_dies_mid_post_is_taken_over_and_delivered_once_more(pair, receiver):
    a, b, clock = pair
    receiver.hold = 1                                       # the first POST gets no answer
    b.runner.start()
    await a.runner.submit(with_callback("t1", receiver), succeeded)
    await receiver.held.wait()                              # A's POST is at the receiver, unanswered
    a.crash()
    record = await b.store.get("t1")
    assert (record.state, record.callback_state, record.callback_owner) == (TaskState.SUCCEEDED, "pending", "gw-a")
    assert await b.store.claimable_callbacks(clock()) == []  # A's delivery lease is live: nobody takes it ...
    clock.now += LEASE_S + 0.1                                # ... until it lapses
    record = await callback_settled(b.store, "t1")
    assert (record.callback_state, record.callback_attempts, record.callback_owner, record.callback_error) == (
        "delivered", 1, "", "")
    first, second = receiver.received                       # exactly one POST more, by B
    assert first.body == second.body and first.path == second.path == "/hooks/done"
    for got in (first, second):
        assert got.headers["x-meshserve-task-id"] == "t1"
        assert verify(SECRET, got.headers["x-meshserve-timestamp"], got.body, got.headers["x-meshserve-signature"])
    assert {got.headers["x-meshserve-task-id"] for got in receiver.received} == {"t1"}  # one after dedup
    assert await b.store.claimable_callbacks(clock.now + 3600) == []  # nothing left for anyone to send
    # the dead deliverer's late record of its attempt is refused (fenced by the delivery's owner)
    assert await a.store.transition("t1", (TaskState.SUCCEEDED,), None, callback_fence="gw-a",
                                    callback_state="failed") is None
    assert (await b.store.get("t1")).callback_state == "delivered"


async def test_a_stopping_gateway_hands_its_delivery_back_at_once(pair, receiver):
    a, b, clock = pair
    receiver.hold = 1
    await a.runner.submit(with_callback("t2", receiver), succeeded)
    await receiver.held.wait()
    await a.runner.close()                                  # SIGTERM: the delivery is handed back, unowned
    record = await b.store.get("t2")
    assert (record.callback_state, record.callback_owner, record.callback_lease_until) == ("pending", "", 0.0)
    assert await b.store.claimable_callbacks(clock()) == ["t2"]  # no lease to wait for
    b.runner.start()
    record = await callback_settled(b.store, "t2")
    assert (record.callback_state, record.callback_attempts) == ("delivered", 1)
    assert len(receiver.received) == 2 and receiver.received[0].body == receiver.received[1].body


async def test_a_gateway_without_callbacks_never_claims_a_delivery(pair, receiver, redis_url):
    a, _b, clock = pair
    plain = TaskRunner(RedisTaskStore(redis_url, ttl_s=600), clock, heartbeat_s=0.02, owner="gw-plain",
                       lease_s=LEASE_S, claim_poll_s=0.02, resume=a._resume, delivers_callbacks=False)
    try:
        await plain.submit(with_callback("t3", receiver), succeeded)
        deadline = asyncio.get_running_loop().time() + 60
        while (record := await a.store.get("t3")).state != TaskState.SUCCEEDED:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        assert (record.callback_state, record.callback_owner) == ("pending", "")  # left for a gateway that can
        assert await plain.store.claimable_callbacks(clock()) == ["t3"]
        a.runner.start()
        record = await callback_settled(a.store, "t3")
        assert (record.callback_state, len(receiver.received)) == ("delivered", 1)
    finally:
        await plain.close()
        await plain.store.close()
