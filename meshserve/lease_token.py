"""Signed leases: the scheduler's proof that a request may run on one executor.

The scheduler signs each lease it hands out (``LeaseSigner``); the gateway
passes the signed bytes to ``Executor.Execute``; the executor checks them
(``LeaseVerifier``) before it runs anything, and refuses with
``PermissionDenied`` a lease that is missing, forged (bad signature, or issued
for another executor, request id or tenant), expired, or already used::

    SignedLease { claims: bytes (a serialized LeaseClaims), signature: Ed25519(claims) }

**Why Ed25519 (RFC 8032) and not HMAC-SHA256.** Only the scheduler holds the
private key; executors hold the public key, which the scheduler sends them in
``RegisterAck`` when they connect. So there is no shared secret to configure,
distribute or rotate, and an executor (or anyone who reads its memory) cannot
mint leases. The key pair is made when the scheduler starts; a restarted
scheduler has a new key and the executors get it when they reconnect (their
old leases die with the old scheduler's lease table anyway). Signing and
verifying cost tens of microseconds (``cryptography``, OpenSSL).

The signature covers the claims' bytes as sent; the verifier parses only
bytes whose signature it checked, so no re-serialization is ever compared.

**Replay.** Every lease carries 16 random bytes (``nonce``); a verifier accepts
a nonce once and remembers it until the lease's expiry (after which the lease
is refused as expired anyway), so its memory is bounded by the leases issued
within one lease lifetime.

**Clocks.** ``expires_at_unix_s`` is wall-clock time: scheduler and executor
hosts must agree on the time to well within the lease lifetime (NTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from google.protobuf.message import DecodeError

from meshserve.errors import PermissionDenied
from meshserve.timeouts import wait_for
from meshserve.v1 import scheduler_pb2

NONCE_BYTES = 16
PUBLIC_KEY_BYTES = 32
MAX_SIGNED_LEASE_BYTES = 4096  # a lease is ~150 bytes; anything larger is not one


@dataclass(frozen=True)
class LeaseClaims:
    """What a lease grants (the fields of the ``LeaseClaims`` message).

    Attributes:
        lease_id: the lease's id.
        request_id: the request id the gateway admitted (unscoped).
        tenant: the tenant it was admitted for.
        executor_id: the only executor that may run it.
        num_blocks: KV blocks admission counted for it (blocks).
        expires_at_unix_s: wall-clock expiry (Unix seconds).
        nonce: 16 random bytes, accepted once per verifier.
        priority: the priority class admission gave it (ceiling applied).
        max_tokens: the most tokens each choice may generate, from its tenant's KV
            quota (``scheduler.quotas.quota_max_tokens``); 0: no bound but the
            request's own ``max_tokens``.
    """

    lease_id: str
    request_id: str
    tenant: str
    executor_id: str
    num_blocks: int
    expires_at_unix_s: float
    nonce: bytes
    priority: int = 0
    max_tokens: int = 0

    def to_proto(self) -> scheduler_pb2.LeaseClaims:
        return scheduler_pb2.LeaseClaims(
            lease_id=self.lease_id, request_id=self.request_id, tenant=self.tenant, executor_id=self.executor_id,
            num_blocks=self.num_blocks, expires_at_unix_s=self.expires_at_unix_s, nonce=self.nonce,
            priority=self.priority, max_tokens=self.max_tokens)

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.LeaseClaims) -> LeaseClaims:
        return cls(msg.lease_id, msg.request_id, msg.tenant, msg.executor_id, msg.num_blocks,
                   msg.expires_at_unix_s, bytes(msg.nonce), msg.priority, msg.max_tokens)


class LeaseSigner:
    """The scheduler's signing key (a fresh Ed25519 key pair unless one is given).

    Args:
        private_key: the key to sign with (tests pass their own); None: a new one.
    """

    def __init__(self, private_key: Ed25519PrivateKey | None = None):
        self._key = private_key or Ed25519PrivateKey.generate()
        self.public_key: bytes = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, claims: LeaseClaims) -> bytes:
        """The serialized ``SignedLease`` of ``claims`` (what Execute takes)."""
        body = claims.to_proto().SerializeToString()
        return scheduler_pb2.SignedLease(claims=body, signature=self._key.sign(body)).SerializeToString()


def new_nonce() -> bytes:
    """16 random bytes from the OS's CSPRNG."""
    return os.urandom(NONCE_BYTES)


class LeaseVerifier:
    """An executor's check of the leases presented to Execute.

    Args:
        executor_id: this executor's registry id (leases for others are refused).
        clock: wall-clock time in Unix seconds (tests pass a fake one).

    The scheduler's public key arrives with each registration
    (``set_public_key``); until then every lease is refused.
    """

    def __init__(self, executor_id: str, clock: Callable[[], float] = time.time):
        self.executor_id = executor_id
        self._clock = clock
        self._public_key: Ed25519PublicKey | None = None
        self._key_set = asyncio.Event()  # set with the key (wait_for_key)
        self._used: dict[bytes, float] = {}  # nonce -> the lease's expiry (Unix s)
        self.num_refused = 0

    def set_public_key(self, raw: bytes) -> None:
        """Takes the scheduler's public key (32 raw bytes, from ``RegisterAck``).

        Raises:
            ValueError: not a 32-byte Ed25519 public key.
        """
        if len(raw) != PUBLIC_KEY_BYTES:
            raise ValueError(f"a lease public key is {PUBLIC_KEY_BYTES} bytes, got {len(raw)}")
        self._public_key = Ed25519PublicKey.from_public_bytes(raw)
        self._key_set.set()

    async def wait_for_key(self, timeout_s: float) -> None:
        """Returns once the key is set, or after ``timeout_s`` seconds without it (then
        ``verify`` refuses: PERMISSION_DENIED)."""
        if self._public_key is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._key_set.wait(), timeout_s)

    @property
    def has_public_key(self) -> bool:
        """Whether the scheduler's key arrived (``set_public_key``)."""
        return self._public_key is not None

    def num_remembered(self) -> int:
        """Nonces remembered (used leases not yet expired)."""
        return len(self._used)

    def verify(self, signed: bytes, request_id: str, tenant: str) -> LeaseClaims:
        """Checks a signed lease for ``request_id`` of ``tenant`` on this executor
        and marks it used.

        Returns:
            Its claims.

        Raises:
            PermissionDenied: no public key yet, a missing or malformed lease, a bad
                signature, claims for another executor, request id or tenant, an
                expired lease, or a nonce already used.
        """
        try:
            claims = self._check(signed, request_id, tenant)
        except PermissionDenied:
            self.num_refused += 1
            raise
        self._used[claims.nonce] = claims.expires_at_unix_s
        return claims

    def _check(self, signed: bytes, request_id: str, tenant: str) -> LeaseClaims:
        if self._public_key is None:
            raise PermissionDenied("no lease can be checked: this executor has no scheduler key (not registered)")
        if not signed:
            raise PermissionDenied("missing lease: Execute needs the signed lease of the scheduler's Assignment")
        if len(signed) > MAX_SIGNED_LEASE_BYTES:
            raise PermissionDenied(f"lease of {len(signed)} bytes is not a lease")
        try:
            msg = scheduler_pb2.SignedLease.FromString(signed)
            self._public_key.verify(msg.signature, msg.claims)
            claims = LeaseClaims.from_proto(scheduler_pb2.LeaseClaims.FromString(msg.claims))
        except (DecodeError, InvalidSignature, ValueError):
            raise PermissionDenied("lease signature is not the scheduler's") from None
        for what, got, want in (("executor", claims.executor_id, self.executor_id),
                                ("request id", claims.request_id, request_id), ("tenant", claims.tenant, tenant)):
            if got != want:
                raise PermissionDenied(f"lease {claims.lease_id} was issued for another {what}")
        now = self._clock()
        self._forget_expired(now)
        if now >= claims.expires_at_unix_s:
            raise PermissionDenied(f"lease {claims.lease_id} expired {now - claims.expires_at_unix_s:.1f} s ago")
        if len(claims.nonce) != NONCE_BYTES or claims.nonce in self._used:
            raise PermissionDenied(f"lease {claims.lease_id} was already used")
        return claims

    def _forget_expired(self, now: float) -> None:
        """Drops the nonces of expired leases (they are refused as expired now)."""
        if self._used and min(self._used.values()) <= now:
            self._used = {n: t for n, t in self._used.items() if t > now}
