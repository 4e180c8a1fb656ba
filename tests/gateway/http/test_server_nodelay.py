"""The gateway's HTTP server turns Nagle off on the connections it accepts, so a
keep-alive response (written by uvicorn as head, then body) is not held back until
the client's delayed ACK (~40 ms a request on Linux)."""

import asyncio
import socket

from gateway.http.server import HttpServer


async def _ok(scope, receive, send):
    """A minimal ASGI app: 200 with a 2-byte body."""
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_accepted_http_connections_have_tcp_nodelay():
    server = HttpServer(_ok, port=0)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"ok"
        connections = list(server._server.server_state.connections)
        assert len(connections) == 1
        sock = connections[0].transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        writer.close()
        await writer.wait_closed()
    finally:
        await server.stop(grace_s=1.0)
