"""The wire form of a block payload, shared by the kvstore service and its clients.

A payload is the raw bytes of one block's K/V (``meshserve.block_hash.KVLayout``
describes its shape and dtype). Every payload travels with a checksum, CRC-32
(``zlib.crc32``, the polynomial of Ethernet and gzip: enough to catch torn or
flipped bytes, not an integrity guarantee against an adversary), and moves in
chunks of at most ``CHUNK_BYTES`` so that no gRPC message nears the message size
limit and a stream can be cancelled between chunks.
"""

from __future__ import annotations

import zlib
from typing import Iterator

CHUNK_BYTES = 1 << 20
"""Largest chunk of one gRPC message (1 MiB)."""


def checksum(data: bytes | memoryview) -> int:
    """CRC-32 of ``data`` as an unsigned 32-bit int."""
    return zlib.crc32(data) & 0xFFFFFFFF


def chunks(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``data`` in consecutive slices of at most ``chunk_bytes`` bytes (one empty
    slice for empty data, so that a block always has a first message)."""
    if len(data) <= chunk_bytes:
        yield bytes(data) if not isinstance(data, bytes) else data  # one chunk: no copy
        return
    view = memoryview(data)
    for start in range(0, len(data), chunk_bytes):
        yield bytes(view[start:start + chunk_bytes])
