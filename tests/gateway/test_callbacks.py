"""Task callbacks without a model: the allow-list and the address rules (C36), the
signature, delivery once, retries with backoff after a failing receiver, redirects
not followed, and a name resolving to an internal address never dialled."""

from __future__ import annotations

import pytest

from gateway.callbacks import CallbackPolicy, CallbackSender, sign, verify
from meshserve.errors import InvalidArgument
from tests.support.http_receiver import Receiver

SECRET = b"test-secret"


@pytest.fixture
async def receiver():
    r = await Receiver().start()
    yield r
    await r.stop()


@pytest.fixture
async def sentinel():
    s = await Receiver().start()
    yield s
    await s.stop()


@pytest.mark.parametrize("url, reason", [
    ("http://169.254.169.254/latest/meta-data", "internal address (169.254.169.254)"),
    ("http://[::1]:8080/hook", "internal address (::1)"),
    ("http://0x7f000001/hook", "internal address (127.0.0.1)"),
    ("http://2130706433/hook", "internal address (127.0.0.1)"),
    ("http://10.0.0.5/hook", "internal address (10.0.0.5)"),
    ("file:///etc/passwd", "http or https URL"),
    ("gopher://hooks.example.com/", "http or https URL"),
    ("http://user:pw@hooks.example.com/hook", "no user info"),
    ("http://hooks.example.com:99999/", "malformed"),
    ("http://localhost./hook", "allow-list"),
    ("https://evil.example.org/hook", "allow-list"),
    ("https://hooks.example.com/other", "allow-list"),
    # found by a fresh user: these reached the task record and went out as a broken request line
    ("https://hooks.example.com/meshserve\r\nX-Evil: injected", "whitespace or control characters"),
    ("https://hooks.example.com/meshserve/h ook", "whitespace or control characters"),
    ("https://hooks.example.com/meshserve/\x00", "whitespace or control characters"),
    ("https://hooks.example.com/meshserve/" + "a" * 2048, "longer than 2048 characters"),
    # found by a review: a prefix is whole segments, and dot segments would leave it at the receiver's proxy
    ("https://hooks.example.com/meshservex/hook", "allow-list"),
    ("https://hooks.example.com/meshserve/../admin", "'.' or '..' path segment"),
    ("https://hooks.example.com/meshserve/%2e%2E/admin", "'.' or '..' path segment"),
    ("https://hooks.example.com/meshserve/..%2fadmin", "'.' or '..' path segment"),
    ("https://hooks.example.com/meshserve/./x", "'.' or '..' path segment"),
])
def test_urls_outside_the_allow_list_or_internal_are_invalid_arguments(url, reason):
    """C36: literal private, loopback and link-local addresses, other schemes and
    malformed URLs are refused naming callback_url."""
    policy = CallbackPolicy(["https://hooks.example.com/meshserve", "https://*.example.net"])
    with pytest.raises(InvalidArgument) as info:
        policy.check(url)
    assert str(info.value).startswith("callback_url") and reason in str(info.value)


def test_allowed_urls_pass():
    policy = CallbackPolicy(["https://hooks.example.com/meshserve", "https://*.example.net", "http://127.0.0.1:8088/"])
    for url in ("https://hooks.example.com/meshserve/done?x=1", "https://a.b.example.net/x",
                "http://127.0.0.1:8088/cb",  # a loopback receiver the operator named literally
                "https://hooks.example.com/meshserve", "https://hooks.example.com/meshserve/",
                "https://hooks.example.com/meshserve/..done", "https://a.example.net"):
        assert policy.check(url) == url
    with pytest.raises(InvalidArgument):
        policy.check("http://127.0.0.1:8089/cb")     # another port of the same address is not named


def test_the_signature_covers_timestamp_and_body():
    signature = sign(SECRET, 1700000000, b'{"taskId":"t"}')
    assert signature.startswith("sha256=") and len(signature) == 7 + 64
    assert verify(SECRET, "1700000000", b'{"taskId":"t"}', signature)
    assert not verify(SECRET, "1700000001", b'{"taskId":"t"}', signature)
    assert not verify(SECRET, "1700000000", b'{"taskId":"u"}', signature)
    assert not verify(b"other", "1700000000", b'{"taskId":"t"}', signature)


async def test_delivered_once_with_a_valid_signature(receiver):
    sender = CallbackSender(CallbackPolicy([receiver.url + "/"]), SECRET, clock=lambda: 1700000000.0)
    attempts = []

    async def record(attempt):
        attempts.append(attempt)

    last = await sender.deliver(receiver.url + "/hook?k=1", "task-1", b'{"state":"TASK_STATE_SUCCEEDED"}', record)
    assert last.delivered and [(a.number, a.status, a.error) for a in attempts] == [(1, 200, "")]
    (got,) = receiver.received
    assert (got.method, got.path, got.body) == ("POST", "/hook?k=1", b'{"state":"TASK_STATE_SUCCEEDED"}')
    assert got.headers["x-meshserve-timestamp"] == "1700000000"
    assert got.headers["x-meshserve-task-id"] == "task-1" and got.headers["x-meshserve-delivery-attempt"] == "1"
    assert verify(SECRET, got.headers["x-meshserve-timestamp"], got.body, got.headers["x-meshserve-signature"])


async def test_a_failing_receiver_is_retried_with_backoff_then_given_up(receiver):
    receiver.statuses = [503, 500, 200]
    sender = CallbackSender(CallbackPolicy([receiver.url]), SECRET, max_attempts=5, backoff_s=0.001)
    attempts = []

    async def record(attempt):
        attempts.append(attempt)

    assert (await sender.deliver(receiver.url + "/h", "t", b"{}", record)).delivered
    assert [(a.number, a.status) for a in attempts] == [(1, 503), (2, 500), (3, 200)]
    assert [r.headers["x-meshserve-delivery-attempt"] for r in receiver.received] == ["1", "2", "3"]

    receiver.statuses, attempts[:] = [503] * 3, []
    sender.max_attempts = 3
    last = await sender.deliver(receiver.url + "/h", "t", b"{}", record)
    assert (last.delivered, last.number, last.error) == (False, 3, "HTTP 503")
    receiver.statuses = [404]
    last = await sender.deliver(receiver.url + "/h", "t", b"{}", record)  # a 4xx is not retried
    assert (last.number, last.error) == (1, "HTTP 404")


async def test_redirects_are_not_followed(receiver, sentinel):
    """C36: a receiver answering 302 marks the delivery failed; nothing follows it."""
    receiver.statuses = [302]
    sender = CallbackSender(CallbackPolicy([receiver.url]), SECRET)

    async def record(_attempt):
        pass

    last = await sender.deliver(receiver.url + "/h", "t", b"{}", record)
    assert (last.delivered, last.status, last.error) == (False, 302, "HTTP 302 (redirects are not followed)")
    assert len(receiver.received) == 1 and sentinel.connections == 0


async def test_a_name_resolving_to_an_internal_address_is_never_dialled(sentinel):
    """C36: the address checked is the address dialled: ``localhost`` resolves to
    loopback, which no entry names literally, so the sentinel sees no connection."""
    sender = CallbackSender(CallbackPolicy([f"http://localhost:{sentinel.port}/"]), SECRET, max_attempts=2,
                            backoff_s=0.001)

    async def record(_attempt):
        pass

    last = await sender.deliver(f"http://localhost:{sentinel.port}/h", "t", b"{}", record)
    assert not last.delivered and "resolves to an internal address" in last.error
    assert sentinel.connections == 0
