"""Signed leases: what an executor's ``LeaseVerifier`` accepts and refuses (case C35's
bad leases: another key, expired, another executor, used before)."""

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshserve.errors import PermissionDenied
from meshserve.lease_token import LeaseClaims, LeaseSigner, LeaseVerifier
from meshserve.v1 import scheduler_pb2


class Clock:
    def __init__(self, t: float = 1_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def claims(nonce: bytes = b"n" * 16, **overrides) -> LeaseClaims:
    fields = dict(lease_id="L1", request_id="r1", tenant="acme", executor_id="e0", num_blocks=3,
                  expires_at_unix_s=1_010.0, nonce=nonce, priority=2, max_tokens=20)
    fields.update(overrides)
    return LeaseClaims(**fields)


def verifier(signer: LeaseSigner, clock: Clock) -> LeaseVerifier:
    v = LeaseVerifier("e0", clock)
    v.set_public_key(signer.public_key)
    return v


def test_a_lease_signed_for_this_executor_request_and_tenant_is_accepted_with_its_claims():
    signer, clock = LeaseSigner(), Clock()
    got = verifier(signer, clock).verify(signer.sign(claims()), "r1", "acme")
    assert got == claims()


@pytest.mark.parametrize("signed, match", [
    (b"", "missing lease"),
    (b"\xff\x00garbage", "not the scheduler's"),
    (b"x" * 5000, "is not a lease"),
])
def test_missing_or_malformed_lease_is_permission_denied(signed, match):
    signer = LeaseSigner()
    v = verifier(signer, Clock())
    with pytest.raises(PermissionDenied, match=match):
        v.verify(signed, "r1", "acme")
    assert v.num_refused == 1 and v.num_remembered() == 0


def test_lease_signed_by_another_key_is_refused():
    """C35: a lease signed by another key."""
    mine, other = LeaseSigner(), LeaseSigner(Ed25519PrivateKey.generate())
    with pytest.raises(PermissionDenied, match="not the scheduler's"):
        verifier(mine, Clock()).verify(other.sign(claims()), "r1", "acme")


def test_claims_changed_after_signing_are_refused():
    signer = LeaseSigner()
    msg = scheduler_pb2.SignedLease.FromString(signer.sign(claims()))
    forged = claims(num_blocks=10_000).to_proto().SerializeToString()
    tampered = scheduler_pb2.SignedLease(claims=forged, signature=msg.signature).SerializeToString()
    with pytest.raises(PermissionDenied, match="not the scheduler's"):
        verifier(signer, Clock()).verify(tampered, "r1", "acme")


@pytest.mark.parametrize("overrides, request_id, tenant, what", [
    ({"executor_id": "e1"}, "r1", "acme", "executor"),          # C35: a lease issued to another executor
    ({}, "r2", "acme", "request id"),
    ({}, "r1", "globex", "tenant"),
])
def test_lease_for_another_executor_request_or_tenant_is_refused(overrides, request_id, tenant, what):
    signer = LeaseSigner()
    with pytest.raises(PermissionDenied, match=f"issued for another {what}"):
        verifier(signer, Clock()).verify(signer.sign(claims(**overrides)), request_id, tenant)


def test_expired_lease_is_refused():
    """C35: an expired lease."""
    signer, clock = LeaseSigner(), Clock()
    v = verifier(signer, clock)
    clock.t = 1_010.0  # exactly at expiry: refused
    with pytest.raises(PermissionDenied, match="expired 0.0 s ago"):
        v.verify(signer.sign(claims()), "r1", "acme")


def test_a_lease_is_accepted_once_and_its_nonce_forgotten_after_expiry():
    """C35: a released (already used) lease presented again."""
    signer, clock = LeaseSigner(), Clock()
    v = verifier(signer, clock)
    signed = signer.sign(claims())
    v.verify(signed, "r1", "acme")
    with pytest.raises(PermissionDenied, match="already used"):
        v.verify(signed, "r1", "acme")
    v.verify(signer.sign(claims(nonce=b"m" * 16, lease_id="L2")), "r1", "acme")  # another lease: fine
    assert v.num_remembered() == 2
    clock.t = 1_011.0
    with pytest.raises(PermissionDenied, match="expired"):
        v.verify(signed, "r1", "acme")
    assert v.num_remembered() == 0  # memory bounded: expired nonces dropped


def test_without_the_scheduler_key_every_lease_is_refused():
    signer = LeaseSigner()
    with pytest.raises(PermissionDenied, match="no scheduler key"):
        LeaseVerifier("e0", Clock()).verify(signer.sign(claims()), "r1", "acme")


def test_public_key_of_the_wrong_size_is_rejected():
    with pytest.raises(ValueError, match="32 bytes"):
        LeaseVerifier("e0").set_public_key(b"short")


@pytest.mark.parametrize("max_tokens, min_tokens, bound, expected", [
    (50, 0, 0, (50, 0)),     # no bound
    (50, 30, 20, (20, 20)),  # bounded, min_tokens with it
    (10, 5, 20, (10, 5)),    # the request asks less than the bound
])
def test_the_executor_generates_at_most_the_leases_max_tokens(max_tokens, min_tokens, bound, expected):
    from executor.server import within_lease
    from meshserve.sampling import SamplingParams

    params = within_lease(SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens), bound)
    assert (params.max_tokens, params.min_tokens) == expected
