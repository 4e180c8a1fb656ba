"""A throwaway redis-server on a free loopback port, for the Redis task-store tests.

Debian's ``redis-server`` (installed by ``make setup`` when missing); nothing is
saved to disk, unless ``persist_dir`` is given: then it runs as deployments must
(``appendonly yes``, ``appendfsync always``, in that directory) and ``restart``
kills it (SIGKILL) and starts it again on the same port and data. Tests that
need it skip when the binary is absent.
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

from meshserve.cli.ports import free_port


class RedisProcess:
    """A redis-server the test controls: ``pause`` (SIGSTOP: its port accepts but never
    answers, like a blocked network), ``resume`` (SIGCONT), ``restart`` (SIGKILL, then
    the same command again: with ``persist_dir`` its data comes back from the
    append-only file)."""

    def __init__(self, proc: subprocess.Popen, url: str, argv: list[str], port: int, timeout_s: float):
        self.proc, self.url, self.argv, self.port, self.timeout_s = proc, url, argv, port, timeout_s

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kills the server (no shutdown save) and starts it again; returns once it answers."""
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = _spawn(self.argv, self.port, self.timeout_s)


def _spawn(argv: list[str], port: int, timeout_s: float) -> subprocess.Popen:
    """Starts ``argv``; returns once it answers PING on ``port``."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"redis-server on port {port} did not start")
        time.sleep(0.05)


@contextmanager
def redis_process(timeout_s: float = 10.0, persist_dir: str | None = None) -> Iterator[RedisProcess]:
    """As ``redis_server``, yielding a ``RedisProcess``."""
    with redis_server(timeout_s, _process=True, persist_dir=persist_dir) as handle:
        yield handle


@contextmanager
def redis_server(timeout_s: float = 10.0, _process: bool = False, persist_dir: str | None = None) -> Iterator[str]:
    """Runs ``redis-server`` on a free loopback port; yields its ``redis://127.0.0.1:PORT/0`` URL.

    Args:
        persist_dir: keep the data there, append-only with an fsync per write (None: nothing saved).

    Raises:
        FileNotFoundError: no ``redis-server`` on the PATH.
        TimeoutError: it did not accept connections within ``timeout_s`` seconds.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (make setup installs it)")
    port = free_port()
    persistence = (["--save", "", "--appendonly", "no"] if persist_dir is None else
                   ["--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(persist_dir)])
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", *persistence]
    handle = RedisProcess(_spawn(argv, port, timeout_s), f"redis://127.0.0.1:{port}/0", argv, port, timeout_s)
    try:
        yield handle if _process else handle.url
    finally:
        handle.proc.send_signal(signal.SIGCONT)
        handle.proc.terminate()
        handle.proc.wait(timeout=10)


def redis_url_or_skip() -> Iterator[str]:
    """For a fixture (``yield from``): the URL of a redis-server started for it, stopped
    afterwards; skips the test when redis-server is not installed."""
    for handle in redis_process_or_skip():
        yield handle.url


@contextmanager
def replica_of(url: str, timeout_s: float = 10.0) -> Iterator[str]:
    """A redis-server replicating the one at ``url`` (``--replicaof``); yields its URL.

    Raises:
        FileNotFoundError: no ``redis-server`` on the PATH.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (make setup installs it)")
    host, port = url.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    own = free_port()
    proc = _spawn([binary, "--port", str(own), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--replicaof", host, port], own, timeout_s)
    try:
        yield f"redis://127.0.0.1:{own}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def redis_process_or_skip() -> Iterator[RedisProcess]:
    """For a fixture (``yield from``): a ``RedisProcess`` started for it, stopped
    afterwards; skips the test when redis-server is not installed."""
    try:
        with redis_process() as handle:
            yield handle
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def acl_user(url: str, name: str, password: str, *rules: str) -> str:
    """Creates the ACL user ``name`` with ``password``, every key and channel and the
    command ``rules`` (e.g. ``"+@all", "-@scripting"``) on the Redis at ``url`` (which
    it reaches as the default user); returns ``url`` with that user's credentials,
    ``redis://NAME:PASSWORD@HOST:PORT/DB``."""
    import redis

    admin = redis.Redis.from_url(url)
    try:
        admin.acl_setuser(name, enabled=True, reset=True, passwords=[f"+{password}"], keys=["*"],
                          channels=["*"], commands=list(rules))
    finally:
        admin.close()
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{name}:{password}@{rest}"
