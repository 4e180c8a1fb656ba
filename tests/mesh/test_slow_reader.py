"""Case C27: a slow streaming reader cannot grow the mesh's memory or hold its KV.

The slow client reads one message, then stops (a client with a small HTTP/2 window,
so that its backlog reaches the mesh quickly). What it leaves unread backs up
through the gateway (which pulls from the executor only as fast as it can write)
into the executor, whose queue for the request is bounded
(``max_buffered_outputs``): past it the request is aborted, its KV blocks freed,
and the client reads RESOURCE_EXHAUSTED after the messages already sent. Normal
clients meanwhile get exactly the tokens they get alone: the engine never waits
for a reader."""

import asyncio

import grpc
import pytest

from meshserve.client import build_request, generate
from meshserve.grpc_server import CHANNEL_OPTIONS, open_channel
from meshserve.request_ids import scoped_request_id
from meshserve.sampling import SamplingParams, to_proto
from meshserve.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2_grpc
from tests.support.engines import make_engine
from tests.support.leases import signed_lease
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model
BOUND = 16
# a reader with a 1 KiB stream window: about 12 token messages in flight to it
SLOW_CLIENT_OPTIONS = CHANNEL_OPTIONS + (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))
QUESTIONS = ("Name a color.", "Count to five.", "What is 2+2?", "Say hello in French.")


async def _normal_clients(m):
    reqs = [build_request(chat=[("user", q)], max_tokens=24, temperature=0, ignore_eos=True) for q in QUESTIONS]
    return await asyncio.gather(*(generate(m.stub, r) for r in reqs))


async def _wait(predicate, timeout_s: float = 240.0) -> None:
    """Polls ``predicate()`` until true; ``timeout_s`` only bounds a hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_slow_reader_is_bounded_ended_and_frees_kv(tokenizer):
    """Case C27: a reader that stops after its first token: the executor buffers at
    most the bound for it, then ends it (RESOURCE_EXHAUSTED after what was sent) and
    frees its KV; normal clients meanwhile get exactly their tokens alone."""
    m = await start_local_mesh([make_engine(max_model_len=4200)], tokenizer, max_buffered_outputs=BOUND)
    slow_channel = open_channel(m.gateway.address, m.tls(), SLOW_CLIENT_OPTIONS)
    try:
        eng = m.executors[0][1]
        alone = await _normal_clients(m)
        slow = gateway_pb2_grpc.GatewayStub(slow_channel).Generate(build_request(
            chat=[("user", "Tell me a very long story.")], max_tokens=4000, temperature=0, ignore_eos=True,
            logprobs=5))
        received = 0
        while received == 0:  # its first token, then it reads nothing
            msg = await slow.read()
            if msg.WhichOneof("kind") == "delta":
                received += len(msg.delta.token_ids)
        with_slow = await _normal_clients(m)
        assert [c.token_ids for c in with_slow] == [c.token_ids for c in alone]
        assert all(len(c.token_ids) == 24 for c in with_slow)

        await _wait(lambda: eng.num_overflowed == 1)
        await m.wait_idle()  # KV freed while the slow client still has not read
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_aborted == 1
        assert eng.max_buffered_seen == BOUND  # never above the bound

        with pytest.raises(grpc.aio.AioRpcError) as err:
            while (msg := await slow.read()) is not grpc.aio.EOF:
                if msg.WhichOneof("kind") == "delta":
                    received += len(msg.delta.token_ids)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"bound {BOUND}" in err.value.details()
        assert BOUND < received < 4000  # what was sent before the bound tripped, not the whole request
        await _wait(lambda: m.scheduler.servicer.core.num_leases() == 0)
        assert len(m.scheduler.servicer.core) == 0
    finally:
        await slow_channel.close()
        await m.stop()


async def _first_delta(call) -> int:
    while True:
        msg = await call.read()
        if msg.WhichOneof("kind") == "delta":
            return len(msg.delta.token_ids)


async def test_slow_reader_with_n_choices_and_a_big_first_message_ends_every_choice(tokenizer):
    """Case C27, n=3 with prompt logprobs of a long prompt (a first message of ~150 KB): every
    choice backs up to the bound and is ended, all KV freed, the caller reads
    RESOURCE_EXHAUSTED; the executor's call and the scheduler's lease end."""
    m = await start_local_mesh([make_engine(max_model_len=4200)], tokenizer, max_buffered_outputs=BOUND)
    slow_channel = open_channel(m.gateway.address, m.tls(), SLOW_CLIENT_OPTIONS)
    try:
        eng = m.executors[0][1]
        servicer = m.executors[0][0].servicer
        slow = gateway_pb2_grpc.GatewayStub(slow_channel).Generate(build_request(
            prompt=[100 + i % 500 for i in range(800)], max_tokens=2500, temperature=0, ignore_eos=True,
            n=3, logprobs=20, prompt_logprobs=20))  # the largest messages: the windows fill soonest
        received = await _first_delta(slow)
        await _wait(lambda: eng.num_overflowed == 3)
        await m.wait_idle()
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_aborted == 3
        assert eng.max_buffered_seen == BOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while (msg := await slow.read()) is not grpc.aio.EOF:
                if msg.WhichOneof("kind") == "delta":
                    received += len(msg.delta.token_ids)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert received < 3 * 2500
        get = m.gateway.servicer.core.metrics.registry.get_sample_value
        labels = {"tenant": "default", "priority": "0"}
        await _wait(lambda: get("meshserve_gateway_requests_running", labels) == 0)
        assert get("meshserve_requests_total", {**labels, "outcome": "resource_exhausted"}) == 1
        assert get("meshserve_request_ttft_seconds_count", labels) == 1
        await _wait(lambda: m.scheduler.servicer.core.num_leases() == 0)
        assert servicer.active_leases == {}
        assert await _normal_clients(m)  # the executor still serves
    finally:
        await slow_channel.close()
        await m.stop()


async def test_cancel_while_n_choices_are_blocked_on_the_merge_queue_frees_kv(tokenizer):
    """Case C27: a slow n=3 reader cancels while its backlog fills every queue on the way (the
    executor's choice pumps wait on the bounded merge queue, below the engine's bound):
    every choice is aborted, no slow-reader abort counted, KV and lease freed."""
    m = await start_local_mesh([make_engine(max_model_len=4200)], tokenizer, max_buffered_outputs=100_000)
    slow_channel = open_channel(m.gateway.address, m.tls(), SLOW_CLIENT_OPTIONS)
    try:
        eng = m.executors[0][1]
        slow = gateway_pb2_grpc.GatewayStub(slow_channel).Generate(build_request(
            chat=[("user", "Tell me a very long story.")], max_tokens=4000, temperature=0, ignore_eos=True, n=3,
            logprobs=5))  # bigger messages: the windows on the way fill sooner
        await _first_delta(slow)
        # a backlog in the engine's queues: the windows on the way are full and the
        # pumps are blocked on the merge queue
        await _wait(lambda: eng.max_buffered_seen >= 20)
        slow.cancel()
        await m.wait_idle()
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_aborted == 3
        assert eng.num_overflowed == 0
        await _wait(lambda: m.scheduler.servicer.core.num_leases() == 0)
        assert eng._streams == {}
        get = m.gateway.servicer.core.metrics.registry.get_sample_value
        labels = {"tenant": "default", "priority": "0"}
        await _wait(lambda: get("meshserve_gateway_requests_running", labels) == 0)
        assert get("meshserve_requests_total", {**labels, "outcome": "cancelled"}) == 1
        assert get("meshserve_request_e2e_seconds_count", labels) == 1
        assert get("meshserve_request_ttft_seconds_count", labels) == 1
    finally:
        await slow_channel.close()
        await m.stop()


async def test_executor_frees_choice_ids_with_the_request_id_so_a_retry_is_accepted(tokenizer):
    """Case C27: when the executor's Execute call of an n=3 request ends (cancelled while its choice
    pumps wait on the merge queue), the request id is free again only once no engine
    stream of its choices is left: an immediate retry with the same id is accepted."""
    m = await start_local_mesh([make_engine(max_model_len=4200)], tokenizer, max_buffered_outputs=100_000)
    slow_channel = open_channel(m.executors[0][0].address, m.tls("gateway"), SLOW_CLIENT_OPTIONS)
    try:
        eng, servicer = m.executors[0][1], m.executors[0][0].servicer
        req = executor_pb2.ExecuteRequest(request_id="r", lease_id="l1", prompt_token_ids=[7] * 20,
                                          lease=signed_lease(m, 0, "r"), tenant="default")
        to_proto(SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True, n=3), req.sampling)
        call = executor_pb2_grpc.ExecutorStub(slow_channel).Execute(req)
        await call.read()
        await _wait(lambda: eng.max_buffered_seen >= 20)  # the pumps wait on the merge queue
        call.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 240  # a hang bound; the loop looks at every turn of the event loop
        while scoped_request_id("default", "r") in servicer.active_leases:
            assert loop.time() < deadline, "the request id was never freed"
            await asyncio.sleep(0)
        assert sorted(eng._streams) == []
        # the retry, at once, with the same id: accepted, and every choice runs whole
        retry = executor_pb2.ExecuteRequest(request_id="r", lease_id="l2", prompt_token_ids=[7] * 20,
                                            lease=signed_lease(m, 0, "r"), tenant="default")
        to_proto(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, n=3), retry.sampling)
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finished = []
        async for msg in executor_pb2_grpc.ExecutorStub(slow_channel).Execute(retry):
            tokens[msg.index] += msg.token_ids
            if msg.finish_reason:
                finished.append(msg.index)
        assert sorted(finished) == [0, 1, 2] and [len(t) for t in tokens.values()] == [2, 2, 2]
        assert tokens[0] == tokens[1] == tokens[2]  # greedy: the same tokens for every choice
    finally:
        await slow_channel.close()
        await m.stop()
