"""A throwaway redis-server on a free loopback port, for the Redis task-store tests.

Debian's ``redis-server`` (installed by ``make setup`` when missing); nothing is
saved to disk. Tests that need it skip when the binary is absent.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

import pytest


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A redis-server the test controls: ``pause`` (SIGSTOP: its port accepts but never
    answers, like a blocked network) and ``resume`` (SIGCONT)."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


@contextmanager
def redis_process(timeout_s: float = 10.0) -> Iterator[RedisProcess]:
    """As ``redis_server``, yielding a ``RedisProcess``."""
    with redis_server(timeout_s, _process=True) as handle:
        yield handle


@contextmanager
def redis_server(timeout_s: float = 10.0, _process: bool = False) -> Iterator[str]:
    """Runs ``redis-server`` on a free loopback port; yields its ``redis://127.0.0.1:PORT/0`` URL.

    Raises:
        FileNotFoundError: no ``redis-server`` on the PATH.
        TimeoutError: it did not accept connections within ``timeout_s`` seconds.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (make setup installs it)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/0"
        yield RedisProcess(proc, url) if _process else url
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def redis_url_or_skip() -> Iterator[str]:
    """For a fixture (``yield from``): the URL of a redis-server started for it, stopped
    afterwards; skips the test when redis-server is not installed."""
    try:
        with redis_server() as url:
            yield url
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
