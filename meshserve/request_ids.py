"""Request ids: their length limit and their scope (one tenant's ids are its own).

A caller names its request (``request_id``); two tenants may pick the same
name, and neither may learn the other's ids by a collision (an "already in
use" answer) or reach the other's request with it (cancel, lookups). So every
service that keys state by request id keys it by ``scoped_request_id(tenant,
request_id)``: the gateway's ids in flight, the scheduler's queue and leases,
the executor's engine requests. The form is length-prefixed, so no choice of
tenant name and id can produce another pair's key.
"""

from __future__ import annotations

import hashlib

from meshserve.errors import InvalidArgument
from meshserve.sampling import is_unicode

MAX_REQUEST_ID_LEN = 256
"""Longest request id accepted, in characters (ids travel in every hop, span and log)."""


def check_request_id(request_id: str) -> None:
    """Raises ``InvalidArgument`` for an id longer than ``MAX_REQUEST_ID_LEN``."""
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request_id has {len(request_id)} characters; the limit is {MAX_REQUEST_ID_LEN}")
    if not is_unicode(request_id):
        raise InvalidArgument("request_id is not valid Unicode (a lone surrogate)")


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The key of ``request_id`` within ``tenant``: ``"<len(tenant)>:<tenant>/<request_id>"``."""
    return f"{len(tenant)}:{tenant}/{request_id}"


def suffixed_request_id(request_id: str, suffix: str) -> str:
    """``request_id + suffix``, the id of a request derived from the caller's (a task's
    retry, one prompt of several). A ``request_id`` too long for the suffix is cut to fit
    ``MAX_REQUEST_ID_LEN``, keeping ``~`` and 16 hex digits of the full id's SHA-256 (two
    long ids that differ only at their end keep distinct derived ids): a valid id never
    makes a derived one fail as the caller's mistake."""
    if len(request_id) + len(suffix) <= MAX_REQUEST_ID_LEN:
        return request_id + suffix
    digest = "~" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return request_id[: MAX_REQUEST_ID_LEN - len(digest) - len(suffix)] + digest + suffix


def attempt_request_id(request_id: str, attempt: int) -> str:
    """The id attempt ``attempt`` (> 1) of a task runs under: ``"<request_id>.attempt<n>"``
    (``suffixed_request_id``), so that it never meets a lease an earlier attempt may still
    hold under the plain id."""
    return suffixed_request_id(request_id, f".attempt{attempt}")
