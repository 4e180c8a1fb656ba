"""uvicorn's own log lines (a malformed request, an exception in the app) are the
gateway's log lines: the process's format, led by the service's name in a local mesh
(``meshserve.log_format``), not uvicorn's ``WARNING:  …`` that no service name leads."""

import os
import subprocess
import sys
import textwrap

from meshserve.log_format import LOG_NAME_ENV

SCRIPT = textwrap.dedent("""
    import asyncio

    from gateway.http.server import HttpServer
    from meshserve.cli.options import setup_logging


    async def app(scope, receive, send):
        pass


    async def main():
        server = HttpServer(app, port=0)
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"NOT HTTP\\x00\\r\\n\\r\\n")
        await writer.drain()
        assert (await reader.read()).startswith(b"HTTP/1.1 400 Bad Request")
        writer.close()
        await server.stop(grace_s=1.0)


    setup_logging("info")
    asyncio.run(main())
""")


def test_uvicorns_warning_is_a_line_of_the_named_service():
    env = dict(os.environ, **{LOG_NAME_ENV: "gateway"})
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert [line.split(" ", 3)[3] for line in lines if "Invalid HTTP request" in line] == [
        "uvicorn.error WARNING Invalid HTTP request received."]
    assert all(line.startswith("[gateway] ") for line in lines), lines
