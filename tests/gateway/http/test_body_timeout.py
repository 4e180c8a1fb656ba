"""A request body that stops arriving gets 408 and its connection closed
(``gateway.http.body_guards.BodyTimeout``): on the gateway's real HTTP port over a raw
socket, and on the middleware itself, whose bound is per part of the body and never
covers the wait for a client after its body (a streaming response's disconnect watch)."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.http.body_guards import BODY_TIMEOUT_S, BodyTimeout
from tests.support.served_gateway import served_gateway

STALLED = {"error": {"message": "the request body stopped arriving: nothing for 0.5 s",
                     "type": "invalid_request_error", "param": None, "code": "timeout"}}


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), 60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/tasks"])
async def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(path):
    async with served_gateway(http_body_timeout_s=0.5) as (client, svc):
        host, port = svc.http.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n{\"prompt\": ".encode())
        await writer.drain()
        raw = await _read_all(reader)  # returns once the server closed the connection
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        assert lines[0] == "HTTP/1.1 408 Request Timeout"
        assert "connection: close" in [line.lower() for line in lines[1:]]
        assert json.loads(body) == STALLED
        assert (await client.get("/health")).status_code == 200  # the server goes on


def test_the_gateway_flag_defaults_to_the_middleware_bound():
    """``meshserve gateway --http-body-timeout-s`` defaults to ``BODY_TIMEOUT_S`` (30 s),
    which ``start_gateway`` applies when given none."""
    import inspect

    from meshserve.cli.services import gateway

    flag = inspect.signature(gateway).parameters["http_body_timeout_s"].default
    assert (flag.default, BODY_TIMEOUT_S) == (30.0, 30.0)


class Client:
    """The ASGI ``receive`` of a client whose messages a test puts in ``messages``."""

    def __init__(self):
        self.messages: asyncio.Queue = asyncio.Queue()

    async def receive(self) -> dict:
        return await self.messages.get()


def reading_app(log: list):
    """An ASGI app that reads the whole body, answers 200 with its length, then watches
    for the client's disconnect as a streaming response does; ``log`` gets what it read."""
    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            log.append(message["type"])
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode(), "more_body": True})
        log.append((await receive())["type"])  # the disconnect watch: unbounded
        await send({"type": "http.response.body", "body": b""})
    return app


async def _serve(guard: BodyTimeout, client: Client) -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(guard({"type": "http", "headers": []}, client.receive, send), 60)
    return sent


async def test_a_stalled_body_is_refused_and_the_app_reads_a_disconnect():
    log, client = [], Client()
    client.messages.put_nowait({"type": "http.request", "body": b"{", "more_body": True})
    sent = await _serve(BodyTimeout(reading_app(log), timeout_s=0.2), client)
    assert log == ["http.request", "http.disconnect"]
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["message"] == \
        "the request body stopped arriving: nothing for 0.2 s"
    assert len(sent) == 2  # nothing of the app's after the refusal


async def test_the_bound_is_per_part_and_never_covers_the_wait_after_the_body():
    """Ten parts 0.25 s apart (2.25 s in all) under a 2 s bound are read whole; then the
    app waits 2.5 s for the client's disconnect and is not cut. (Each part comes 1.75 s
    inside the bound: a loaded host that stalls the loop that long between two parts
    would read as a stalled body.)"""
    log, client = [], Client()

    async def paced():
        for _ in range(9):
            client.messages.put_nowait({"type": "http.request", "body": b"x", "more_body": True})
            await asyncio.sleep(0.25)
        client.messages.put_nowait({"type": "http.request", "body": b"x", "more_body": False})
        await asyncio.sleep(2.5)
        client.messages.put_nowait({"type": "http.disconnect"})

    feeder = asyncio.create_task(paced())
    sent = await _serve(BodyTimeout(reading_app(log), timeout_s=2.0), client)
    await feeder
    assert log == ["http.request"] * 10 + ["http.disconnect"]
    assert [m.get("status") for m in sent] == [200, None, None]
    assert sent[1]["body"] == b"10"


async def test_a_timeout_of_zero_is_refused():
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        BodyTimeout(reading_app([]), timeout_s=0)
