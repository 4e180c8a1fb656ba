"""Chain hashes of full KV blocks: the one identity of cached prefix KV.

Shared by the executor's prefix cache, the kvstore's keys and the scheduler's
prefix-aware routing, so all three name the same block the same way.

A block holds ``block_size`` consecutive tokens of a sequence. Its hash covers
its own token ids *and* its parent's hash, so equal hashes mean equal whole
prefixes, not just equal blocks (vLLM's prefix caching, Kwon et al. SOSP '23;
SGLang's RadixAttention keys the same information as a tree)::

    h0 = H(root,  tokens[0:16])          root = H(fingerprint)
    h1 = H(h0,    tokens[16:32])
    h2 = H(h1,    tokens[32:48])   ...   only *full* blocks are hashed

The root is derived from a ``ModelFingerprint`` (model id, revision, dtype,
adapter), so KV computed by different weights or in another dtype never matches
(case C06). Block size is implied by the token count of each block, so two block
sizes give different hashes as well.

**Routing chain.** The scheduler's prefix-aware router matches the gateway's
hashes of a prompt against the blocks executors report. The gateway knows the
model id and revision (it resolves the same model files) but not the dtype an
executor picked (``--dtype auto`` depends on the executor's hardware), so
routing uses the chain rooted at ``routing_fingerprint(fp)``: the same
fingerprint without the dtype. The executor translates its cache's events into
that chain (``executor.kv_events``); the KV identity used for reuse (engine,
kvstore) keeps the dtype. On the wire a hash is 16 bytes, little-endian
(``hash_to_bytes``).

H is SHA-256 over a fixed little-endian encoding, truncated to 128 bits: stable
across processes and Python versions (unlike ``hash()``), so hashes can cross the
network. Cost: about 1 µs per block of 16 tokens.

The kvstore keys a block by ``(namespace, chain hash)``: the namespace
(``KVStoreFingerprint.namespace``, the same truncated SHA-256) adds the KV
*layout* (block size, layers, KV heads, head dim, tensor-parallel rank and size)
to the model identity, so two executors share a stored block only when its bytes
mean the same thing to both.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

BlockHash = int
"""A 128-bit chain hash (non-negative int)."""

_HASH_BYTES = 16


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes KV computed by one model differ from another's.

    Attributes:
        model_id: model name or path as served.
        revision: weights revision (e.g. a content hash of the checkpoint).
        dtype: activation / KV dtype name (``"float32"``, ``"bfloat16"``).
        adapter: LoRA adapter id, or "" for the base model.
    """

    model_id: str
    revision: str
    dtype: str
    adapter: str = ""

    @property
    def root_hash(self) -> BlockHash:
        """The parent hash of every sequence's first block."""
        return _digest_fields("meshserve-kv-v1", self.model_id, self.revision, self.dtype, self.adapter)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    """How one block's K/V bytes are laid out (part of a kvstore key).

    A block's payload is one contiguous tensor of shape
    ``(num_layers, 2, block_size, num_kv_heads, head_dim)`` (K then V per layer)
    in the fingerprint's dtype, little-endian, as ``executor.worker.kv_cache``
    stores it.

    Attributes:
        block_size: tokens per block (>= 1).
        num_layers: attention layers (>= 1).
        num_kv_heads: KV heads held by this rank (>= 1).
        head_dim: channels per head (>= 1).
        tp_rank: tensor-parallel rank of the holder, in [0, tp_size).
        tp_size: tensor-parallel group size (>= 1).
    """

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")


@dataclass(frozen=True)
class KVStoreFingerprint:
    """Model identity plus KV layout: the namespace of a kvstore key.

    Attributes:
        model: model id, revision, dtype and adapter (also the chain hash root).
        layout: block layout of the payload.
    """

    model: ModelFingerprint
    layout: KVLayout

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload.

        Raises:
            ValueError: the dtype is not float32, bfloat16 or float16.
        """
        size = _DTYPE_BYTES.get(self.model.dtype)
        if size is None:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPE_BYTES)}, got {self.model.dtype!r}")
        lay = self.layout
        return 2 * lay.num_layers * lay.block_size * lay.num_kv_heads * lay.head_dim * size

    @property
    def namespace(self) -> bytes:
        """16 bytes naming (model, revision, dtype, adapter, layout)."""
        m, lay = self.model, self.layout
        value = _digest_fields("meshserve-kvstore-v1", m.model_id, m.revision, m.dtype, m.adapter, lay.block_size,
                               lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.tp_rank, lay.tp_size)
        return value.to_bytes(_HASH_BYTES, "little")


def _digest_fields(*fields: object) -> int:
    """Truncated SHA-256 of fields joined by NUL: the one identity hash of this module."""
    text = "\x00".join(str(f) for f in fields)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:_HASH_BYTES], "little")


def hash_to_bytes(block_hash: BlockHash) -> bytes:
    """A chain hash as 16 little-endian bytes (its wire form)."""
    return block_hash.to_bytes(_HASH_BYTES, "little")


def hash_from_bytes(data: bytes) -> BlockHash:
    """The inverse of ``hash_to_bytes``.

    Raises:
        ValueError: ``data`` is not 16 bytes.
    """
    if len(data) != _HASH_BYTES:
        raise ValueError(f"a block hash is {_HASH_BYTES} bytes, got {len(data)}")
    return int.from_bytes(data, "little")


def routing_fingerprint(fp: ModelFingerprint) -> ModelFingerprint:
    """The fingerprint of the routing chain: ``fp`` without its dtype (see the module docstring)."""
    return ModelFingerprint(fp.model_id, fp.revision, "", fp.adapter)


def hash_to_bytes(block_hash: BlockHash) -> bytes:
    """The 16-byte little-endian wire form of a chain hash."""
    return block_hash.to_bytes(_HASH_BYTES, "little")


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The chain hash of one block.

    Args:
        parent_hash: the previous block's hash, or ``ModelFingerprint.root_hash``
            for a sequence's first block.
        token_ids: the block's token ids (each in [0, 2**32)).

    Returns:
        A 128-bit non-negative int.
    """
    h = hashlib.sha256(parent_hash.to_bytes(_HASH_BYTES, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest()[:_HASH_BYTES], "little")


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent_hash: BlockHash,
                     start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    Args:
        token_ids: the whole sequence so far.
        block_size: tokens per block (>= 1).
        parent_hash: hash of block ``start_block - 1`` (the root hash when 0).
        start_block: first block to hash (blocks before it are already known).

    Returns:
        One hash per full block ``start_block .. len(token_ids) // block_size - 1``;
        a trailing partial block is not hashed.
    """
    hashes = []
    for b in range(start_block, len(token_ids) // block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[b * block_size:(b + 1) * block_size])
        hashes.append(parent_hash)
    return hashes


def routing_block_hashes(token_ids: Sequence[int], block_size: int, model_id: str, revision: str,
                         adapter: str = "") -> list[bytes]:
    """The routing chain of a prompt's full blocks, in wire form (what the gateway sends).

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per block (>= 1); the executors' ``block_size``.
        model_id, revision, adapter: the model identity (as ``ModelFingerprint``).

    Returns:
        One 16-byte hash per full block; equal to what ``executor.kv_events`` reports
        for the same tokens cached by an engine serving that model, in any dtype.
    """
    root = routing_fingerprint(ModelFingerprint(model_id, revision, "", adapter)).root_hash
    return [hash_to_bytes(h) for h in hash_full_blocks(token_ids, block_size, root)]
