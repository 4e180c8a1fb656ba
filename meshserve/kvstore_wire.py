"""Proto ↔ domain conversions of the kvstore's wire (fingerprints and hashes), shared by the
kvstore service and its client."""

from __future__ import annotations

from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint, hash_from_bytes
from meshserve.errors import InvalidArgument
from meshserve.v1 import kvstore_pb2


def fingerprint_to_proto(fp: KVStoreFingerprint) -> kvstore_pb2.KVFingerprint:
    """A ``KVStoreFingerprint`` as its proto message."""
    m, lay = fp.model, fp.layout
    return kvstore_pb2.KVFingerprint(
        model_id=m.model_id, revision=m.revision, dtype=lay.dtype, adapter=m.adapter, block_size=lay.block_size,
        num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, tp_rank=lay.tp_rank,
        tp_size=lay.tp_size)


def fingerprint_from_proto(msg: kvstore_pb2.KVFingerprint) -> KVStoreFingerprint:
    """The fingerprint a caller sent, validated.

    Raises:
        InvalidArgument: empty model_id, an unknown dtype, or a layout field out of
            range (the message names the field).
    """
    if not msg.model_id:
        raise InvalidArgument("fingerprint.model_id must not be empty")
    try:
        fp = KVStoreFingerprint(
            ModelFingerprint(msg.model_id, msg.revision, msg.adapter),
            KVLayout(msg.block_size, msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.dtype, msg.tp_rank,
                     msg.tp_size or 1))
    except ValueError as exc:
        raise InvalidArgument(f"fingerprint: {exc}") from None
    return fp


def hashes_from_proto(items) -> list[int]:
    """Chain hashes from their 16-byte wire form.

    Raises:
        InvalidArgument: an entry is not 16 bytes.
    """
    try:
        return [hash_from_bytes(h) for h in items]
    except ValueError as exc:
        raise InvalidArgument(f"block_hashes: {exc}") from None
