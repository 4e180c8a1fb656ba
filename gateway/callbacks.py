"""Task callbacks: which URLs a task may name, and the signed POST of its final status.

**Which URLs** (``CallbackPolicy``, checked at SubmitTask; a refusal is
``InvalidArgument`` naming ``callback_url``, and no task is created): only
``http`` and ``https`` URLs without user info that match an entry of the
gateway's allow-list (``--callback-allow``, repeatable). An entry is a URL
prefix, ``scheme://host[:port][/path]``, matched on whole path segments
(``/hooks/a`` holds ``/hooks/a/done``, not ``/hooks/ab``); its host may be
``*.example.com`` (any sub-domain). A path with a ``.`` or ``..`` segment, raw
or percent-encoded, is refused: a receiver's proxy would resolve it outside the
entry that matched. A host that is a literal address (``127.0.0.1``, ``[::1]``,
``0x7f000001``) is refused when it is private, loopback, link-local,
unspecified, multicast or reserved, unless an entry names that very literal
(an operator's explicit choice, e.g. a receiver on the same machine).

**Delivery** (``CallbackSender``): the host is resolved once per attempt; every
address it resolves to must pass the same address rule (so a name that
resolves to an internal address is refused, whatever it resolved to before),
and the POST dials exactly the address that was checked (no second
resolution). Redirects are never followed: a 3xx marks the delivery failed.
The body is the task's final ``TaskStatus`` as JSON (``protobuf``'s JSON
mapping), with these headers::

    X-Meshserve-Timestamp: 1764612345                 Unix seconds when signed
    X-Meshserve-Signature: sha256=<hex>               HMAC-SHA256(secret, timestamp + "." + body)
    X-Meshserve-Task-Id: task-…
    X-Meshserve-Delivery-Attempt: 1                   1, 2, … (the same body each time)

A 2xx answer delivers it; a connection error, a timeout, 408, 429 or 5xx is
retried after ``backoff_s`` · 2^k (k = 0, 1, …), at most ``max_attempts``
POSTs; any other answer fails it at once. A receiver verifies the signature
over the raw body and refuses old timestamps (replays).

Delivery is at least once: a POST whose answer is lost (a timeout, or the
delivering gateway killed mid-POST, whose pending delivery another gateway then
takes over, ``gateway.task_runner``) is sent again, with the same body (the
task's final status; its ``callback`` field is left out, so every gateway sends
the same bytes) and possibly the same attempt number. ``X-Meshserve-Task-Id``
is the idempotency key: a task has one final status, so a receiver that has
processed a task id drops any later POST of it (answering 2xx).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence
from urllib.parse import SplitResult, unquote, urlsplit

from meshserve.errors import InvalidArgument
from meshserve.timeouts import wait_for

_DEFAULT_PORTS = {"http": 80, "https": 443}
_RETRIED_STATUSES = {408, 429}


MAX_CALLBACK_URL_CHARS = 2048
"""The longest callback URL accepted (the common practical limit of browsers and proxies)."""


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The ``X-Meshserve-Signature`` value: ``sha256=`` + hex HMAC-SHA256 over
    ``b"<timestamp>." + body``."""
    return "sha256=" + hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify(secret: bytes, timestamp: str, body: bytes, signature: str) -> bool:
    """True when ``signature`` is ``sign(secret, int(timestamp), body)`` (constant time)."""
    try:
        expected = sign(secret, int(timestamp), body)
    except ValueError:
        return False
    return hmac.compare_digest(expected, signature)


def literal_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a URL host spells literally (dotted, bracketed IPv6, or the numeric
    forms ``inet_aton`` takes, such as ``0x7f000001`` or ``2130706433``), else None."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefxABCDEFX." for c in host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for addresses a callback must not reach unless named explicitly."""
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    return (address.is_private or address.is_loopback or address.is_link_local or address.is_unspecified
            or address.is_multicast or address.is_reserved)


@dataclass(frozen=True)
class _Entry:
    scheme: str
    host: str  # lower case; "*.example.com" matches sub-domains
    port: int
    path: str

    def matches(self, url: SplitResult, port: int) -> bool:
        host = (url.hostname or "").lower()
        if self.host.startswith("*."):
            host_ok = host.endswith(self.host[1:])
        else:
            host_ok = host == self.host
        return url.scheme == self.scheme and host_ok and port == self.port and _under(url.path or "/", self.path)


def _under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or below it, on whole segments (``/hooks/a`` and
    ``/hooks/a/`` hold ``/hooks/a/x``, never ``/hooks/ab``)."""
    if path == prefix or prefix.endswith("/") and path.startswith(prefix):
        return True
    return path.startswith(prefix + "/")


def _has_dot_segment(path: str) -> bool:
    """Whether ``path`` holds a ``.`` or ``..`` segment, raw or percent-encoded (``%2e``):
    a receiver's proxy may resolve it to a path outside the entry that matched."""
    return any(segment in (".", "..") for segment in unquote(path).split("/"))  # %2F hides no segment


class CallbackPolicy:
    """The allow-list of callback URLs (see the module docstring).

    Args:
        allow: entries ``scheme://host[:port][/path]``; empty: every callback is refused.

    Raises:
        ValueError: a malformed entry (the message names it).
    """

    def __init__(self, allow: Sequence[str] = ()):
        self._entries: list[_Entry] = []
        self.explicit: set[str] = set()  # literal internal hosts an entry names
        for text in allow:
            url = urlsplit(text)
            if url.scheme not in _DEFAULT_PORTS or not url.hostname:
                raise ValueError(f"--callback-allow {text!r}: expected http(s)://host[:port][/path]")
            port = url.port or _DEFAULT_PORTS[url.scheme]
            self._entries.append(_Entry(url.scheme, url.hostname.lower(), port, url.path or "/"))
            if literal_address(url.hostname) is not None:
                self.explicit.add(str(literal_address(url.hostname)))

    def check(self, url_text: str) -> str:
        """Returns the URL when a task may call it back.

        Raises:
            InvalidArgument: naming ``callback_url`` and why (also: longer than
                ``MAX_CALLBACK_URL_CHARS``, or holding whitespace or control characters,
                which a request line cannot carry).
        """
        if len(url_text) > MAX_CALLBACK_URL_CHARS:
            raise InvalidArgument(f"callback_url is longer than {MAX_CALLBACK_URL_CHARS} characters")
        if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url_text):
            raise InvalidArgument("callback_url is malformed: it holds whitespace or control characters "
                                  "(percent-encode them)")
        try:
            url = urlsplit(url_text)
            port = url.port or _DEFAULT_PORTS.get(url.scheme)
        except ValueError as exc:
            raise InvalidArgument(f"callback_url is malformed: {exc}") from None
        if url.scheme not in _DEFAULT_PORTS:
            raise InvalidArgument(f"callback_url must be an http or https URL, got scheme {url.scheme!r}")
        if not url.hostname or url.username is not None or url.password is not None:
            raise InvalidArgument("callback_url must name a host and no user info")
        if _has_dot_segment(url.path):
            raise InvalidArgument("callback_url has a '.' or '..' path segment (write the path it stands for)")
        address = literal_address(url.hostname)
        if address is not None and internal(address) and str(address) not in self.explicit:
            raise InvalidArgument(f"callback_url names an internal address ({address})")
        if not self.lists(url_text):
            raise InvalidArgument("callback_url is not in the gateway's callback allow-list (--callback-allow)")
        return url_text

    def lists(self, url_text: str) -> bool:
        """Whether an entry matches ``url_text`` (a URL ``check`` accepted)."""
        url = urlsplit(url_text)
        return any(e.matches(url, url.port or _DEFAULT_PORTS[url.scheme]) for e in self._entries)

    def address_allowed(self, address: str) -> bool:
        """Whether a resolved address may be dialled."""
        ip = ipaddress.ip_address(address)
        return not internal(ip) or str(ip) in self.explicit


@dataclass(frozen=True)
class Attempt:
    """One POST's outcome: ``status`` (0 when none came back) and ``error`` ("" when delivered)."""

    number: int
    status: int
    error: str

    @property
    def delivered(self) -> bool:
        return not self.error


class CallbackSender:
    """POSTs signed bodies with bounded retries (see the module docstring).

    Args:
        policy: the allow-list (re-checked on every resolution).
        secret: the HMAC key (``--callback-secret-file``).
        max_attempts: POSTs at most (>= 1).
        backoff_s: the first retry's delay; each next doubles (seconds).
        timeout_s: one POST's bound, connect to answer (seconds).
        clock: Unix seconds (the timestamp signed).
    """

    def __init__(self, policy: CallbackPolicy, secret: bytes, max_attempts: int = 5, backoff_s: float = 0.5,
                 timeout_s: float = 10.0, clock: Callable[[], float] = time.time):
        if not secret:
            raise ValueError("a callback secret is required")
        self.policy, self.secret = policy, secret
        self.max_attempts, self.backoff_s, self.timeout_s, self.clock = max_attempts, backoff_s, timeout_s, clock

    async def deliver(self, url: str, task_id: str, body: bytes,
                      on_attempt: Callable[[Attempt], Awaitable[None]], first: int = 1) -> Attempt:
        """POSTs ``body`` until delivered, refused for good, or out of attempts; awaits
        ``on_attempt`` after each POST. ``first``: the first attempt's number (a
        delivery taken over goes on from the attempts recorded). Returns the last
        attempt (number 0, not delivered, when ``first`` is past ``max_attempts``)."""
        attempt = Attempt(0, 0, f"gave up: {first - 1} attempts made")
        for number in range(first, self.max_attempts + 1):
            timestamp = int(self.clock())
            headers = {"Content-Type": "application/json", "X-Meshserve-Timestamp": str(timestamp),
                       "X-Meshserve-Signature": sign(self.secret, timestamp, body), "X-Meshserve-Task-Id": task_id,
                       "X-Meshserve-Delivery-Attempt": str(number)}
            try:
                status = await wait_for(self._post(url, headers, body), self.timeout_s)
            except (OSError, asyncio.TimeoutError, ValueError, ssl.SSLError) as exc:
                attempt, retry = Attempt(number, 0, f"{type(exc).__name__}: {exc}"), True
            else:
                error = "" if 200 <= status < 300 else (
                    f"HTTP {status} (redirects are not followed)" if 300 <= status < 400 else f"HTTP {status}")
                attempt, retry = Attempt(number, status, error), status >= 500 or status in _RETRIED_STATUSES
            await on_attempt(attempt)
            if attempt.delivered or not retry:
                return attempt
            if number < self.max_attempts:
                await asyncio.sleep(self.backoff_s * 2 ** (number - 1))
        return attempt

    async def _post(self, url_text: str, headers: dict[str, str], body: bytes) -> int:
        """One HTTP/1.1 POST to the checked address; returns the status code.

        Raises:
            ValueError: the host resolves to an address the policy refuses, or the
                answer is not HTTP.
            OSError: the connection failed.
        """
        url = urlsplit(url_text)
        port = url.port or _DEFAULT_PORTS[url.scheme]
        infos = await asyncio.get_running_loop().getaddrinfo(url.hostname, port, type=socket.SOCK_STREAM)
        addresses = [info[4][0] for info in infos]
        refused = [a for a in addresses if not self.policy.address_allowed(a)]
        if refused or not addresses:
            raise ValueError(f"{url.hostname} resolves to an internal address ({', '.join(refused)})")
        tls = ssl.create_default_context() if url.scheme == "https" else None
        reader, writer = await asyncio.open_connection(addresses[0], port, ssl=tls,
                                                       server_hostname=url.hostname if tls else None)
        try:
            host = url.hostname if url.port is None else f"{url.hostname}:{url.port}"
            target = (url.path or "/") + (f"?{url.query}" if url.query else "")
            lines = [f"POST {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}", "Connection: close",
                     *(f"{k}: {v}" for k, v in headers.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            status_line = (await reader.readline()).decode("latin-1").split()
            if len(status_line) < 2 or not status_line[0].startswith("HTTP/") or not status_line[1].isdigit():
                raise ValueError(f"not an HTTP answer: {' '.join(status_line)!r}")
            return int(status_line[1])
        finally:
            writer.close()
