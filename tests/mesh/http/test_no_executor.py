"""A gateway whose scheduler has no executor: HTTP readiness is 503 while liveness is
200 (case C41's gateway side), a request is 503 with Retry-After, and server
reflection lists the gateway's services. No model is loaded."""

import grpc
import httpx2 as httpx
import pytest_asyncio
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.request import ModelInfo
from gateway.server import start_gateway
from scheduler.server import start_scheduler


@pytest_asyncio.fixture(scope="module")
async def lonely_gateway(tokenizer):
    scheduler = await start_scheduler(0)
    gateway = await start_gateway(tokenizer, ModelInfo("default", 1024, tokenizer.vocab_size), scheduler.address, 0,
                                  http_port=0)
    yield gateway
    await gateway.stop(0)
    await gateway.servicer.close()
    await scheduler.stop(0)


async def test_not_ready_without_an_executor_but_alive(lonely_gateway):
    """Case C41: the gateway is not ready while no executor is, including when there are none."""
    async with httpx.AsyncClient(base_url=lonely_gateway.http.url) as http:
        assert (await http.get("/health")).status_code == 200
        r = await http.get("/ready")
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"


async def test_request_without_an_executor_is_503_with_retry_after(lonely_gateway):
    async with httpx.AsyncClient(base_url=lonely_gateway.http.url) as http:
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "service_unavailable" and "no executor" in r.json()["error"]["message"]


async def test_reflection_lists_the_gateway_services(lonely_gateway):
    async with grpc.aio.insecure_channel(lonely_gateway.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = [a async for a in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]))]
    names = sorted(s.name for s in answers[0].list_services_response.service)
    assert names == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "meshserve.v1.Gateway"]


async def test_reflection_lists_the_scheduler_services():
    scheduler = await start_scheduler(0)
    try:
        async with grpc.aio.insecure_channel(scheduler.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = [a async for a in stub.ServerReflectionInfo(iter([
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="meshserve.v1.Scheduler")]))]
    finally:
        await scheduler.stop(0)
    names = sorted(s.name for s in answers[0].list_services_response.service)
    assert names == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "meshserve.v1.Scheduler"]
    assert answers[1].file_descriptor_response.file_descriptor_proto  # the proto file itself is served
