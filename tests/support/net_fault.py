"""A loopback TCP proxy whose traffic can be frozen: a network partition for tests
(connections stay open, nothing gets through either way), then healed."""

from __future__ import annotations

import asyncio


class FreezableProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` ("host:port") while not frozen.
    ``connections``: the connections accepted so far (each with its own to ``target``)."""

    def __init__(self, target: str):
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.base_events.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task] = set()
        self.connections = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    def freeze(self) -> None:
        self._open.clear()

    def thaw(self) -> None:
        self._open.set()

    async def stop(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        self._writers += [writer, up_writer]
        self.connections += 1
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self._open.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            dst.close()
