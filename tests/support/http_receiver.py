"""A callback receiver for tests: an HTTP/1.1 server on 127.0.0.1 that records every
request (method, path, headers, body) and answers each with the next scripted
status (200 once the script is used up); a ``sentinel`` only counts connections.
``hold`` requests are recorded and then held unanswered until ``release`` (a
receiver that is slow to answer while its sender dies); ``held`` is set once one is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Records requests; ``statuses`` are the answers, in order (then 200)."""

    statuses: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    connections: int = 0
    hold: int = 0
    held: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    _server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Receiver:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.release.set()
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            method, path, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
            headers = {}
            while (line := (await reader.readline()).decode("latin-1").strip()):
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.received.append(Received(method, path, headers, body))
            if self.hold > 0:
                self.hold -= 1
                self.held.set()
                await self.release.wait()
            status = self.statuses.pop(0) if self.statuses else 200
            extra = f"Location: {self.url}/elsewhere\r\n" if 300 <= status < 400 else ""
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\n{extra}Connection: close\r\n\r\n".encode())
            await writer.drain()
        except (ValueError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
