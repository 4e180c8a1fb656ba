"""Chain hashes of full KV blocks: the one identity of cached prefix KV.

One chain, computed once per request, names a block everywhere: the executor's
prefix cache, its KV events, the scheduler's prefix index (the gateway sends the
same hashes with a request) and the kvstore's keys.

A block holds ``block_size`` consecutive tokens of a sequence. Its hash covers
its own token ids *and* its parent's hash, so equal hashes mean equal whole
prefixes, not just equal blocks (vLLM's prefix caching, Kwon et al. SOSP '23;
SGLang's RadixAttention keys the same information as a tree)::

    h0 = H(root,  tokens[0:16])          root = H(model id, revision, adapter)
    h1 = H(h0,    tokens[16:32])
    h2 = H(h1,    tokens[32:48])   ...   only *full* blocks are hashed

The root is derived from a ``ModelFingerprint`` (model id, revision, adapter), so
KV computed by different weights never matches. Block size is implied
by the token count of each block, so two block sizes give different hashes as
well. The root has no dtype: the gateway, which computes the chain of a prompt
for routing, cannot know the dtype an executor picked (``--dtype auto`` depends on
its hardware), and one engine's prefix cache holds one dtype only.

What makes cached *bytes* incompatible between executors (dtype, KV layout)
is named once, in the kvstore's namespace: the kvstore
keys a block by ``(KVStoreFingerprint.namespace, chain hash)``, so two executors
share a stored block only when its bytes mean the same thing to both.

H is SHA-256 over a fixed little-endian encoding, truncated to 128 bits: stable
across processes and Python versions (unlike ``hash()``), so hashes can cross the
network. Cost: about 1 µs per block of 16 tokens. On the wire a hash is 16
bytes, little-endian (``hash_to_bytes``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

from meshserve.errors import InvalidArgument

BlockHash = int
"""A 128-bit chain hash (non-negative int)."""

_HASH_BYTES = 16


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes KV computed by one model differ from another's: the chain's root.

    Attributes:
        model_id: model name or path as served.
        revision: weights revision (e.g. a content hash of the checkpoint).
        adapter: LoRA adapter id, or "" for the base model.
    """

    model_id: str
    revision: str
    adapter: str = ""

    @property
    def root_hash(self) -> BlockHash:
        """The parent hash of every sequence's first block."""
        return _digest_fields("meshserve-chain-v1", self.model_id, self.revision, self.adapter)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    """How one block's K/V bytes are laid out (part of a kvstore key).

    A block's payload is one contiguous tensor of shape
    ``(num_layers, 2, block_size, num_kv_heads, head_dim)`` (K then V per layer)
    of ``dtype``, little-endian, as ``executor.worker.kv_cache`` stores it.

    Attributes:
        block_size: tokens per block (>= 1).
        num_layers: attention layers (>= 1).
        num_kv_heads: KV heads in the payload (>= 1): the model's total, since every
            executor, parallel or not, stores whole-model blocks.
        head_dim: channels per head (>= 1).
        dtype: element type: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        tp_rank: tensor-parallel rank of a payload split by rank, in [0, tp_size);
            0 for whole-model payloads, the only kind executors store (a parallel
            group reassembles its blocks: ``executor.worker.kv_connector``).
        tp_size: tensor-parallel split of the payload (>= 1); 1 for whole-model
            payloads, so executors of any parallel layout share blocks.

    Raises:
        ValueError: a size below 1, an unknown dtype, or a rank outside the group.
    """

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPE_BYTES)}, got {self.dtype!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload (K and V of every layer)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class KVStoreFingerprint:
    """Model identity plus KV layout: the namespace of a kvstore key.

    Attributes:
        model: model id, revision and adapter (also the chain hash root).
        layout: block layout of the payload, dtype included.
    """

    model: ModelFingerprint
    layout: KVLayout

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload."""
        return self.layout.block_bytes

    @property
    def namespace(self) -> bytes:
        """16 bytes naming (model, revision, dtype, adapter, layout)."""
        m, lay = self.model, self.layout
        value = _digest_fields("meshserve-kvstore-v1", m.model_id, m.revision, lay.dtype, m.adapter, lay.block_size,
                               lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.tp_rank, lay.tp_size)
        return value.to_bytes(_HASH_BYTES, "little")


PREFIX_CACHE_SCOPES = ("tenant", "global")
"""``--prefix-cache-scope`` values: prefix KV shared within a tenant only (the
default), or across all tenants."""

MAX_CACHE_SALT_CHARS = 256
"""The longest ``cache_salt`` a request may carry (characters): room for a random
256-bit salt (43 base64 characters, vLLM's advice) next to a caller's own ids."""


def cache_salt(scope: str, tenant: str, request_salt: str = "") -> str:
    """A request's chain salt (``salted_root``) under ``scope``: the tenant's name, or ""
    for ``global``; with the request's own ``cache_salt`` (vLLM's), that salt after a NUL.

    A request then shares prefix blocks only with requests of the same tenant (under
    ``tenant``) *and* the same salt; without one, exactly as before salts existed. The
    pair is recovered from the result (a tenant name holds no NUL: the tenants file
    refuses one), so no other tenant or salt gets the same chain; the tenant part comes
    from the request's lease, the caller chooses only its own salt.

    Raises:
        ValueError: an unknown scope, or a request salt with a tenant name holding NUL.
    """
    if scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"prefix cache scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, got {scope!r}")
    salt = tenant if scope == "tenant" else ""
    if not request_salt:
        return salt
    if "\x00" in salt:
        raise ValueError(f"tenant {tenant!r} holds NUL: its requests cannot carry a cache_salt")
    return f"{salt}\x00{request_salt}"


def check_cache_salt(salt: str | None) -> None:
    """Checks a request's own ``cache_salt`` (None: it has none): a non-empty string
    (vLLM refuses an empty one too) of at most ``MAX_CACHE_SALT_CHARS`` characters,
    valid Unicode (a lone surrogate, which JSON can carry, has no UTF-8 form to hash).

    Raises:
        InvalidArgument: the message names ``cache_salt`` and what is wrong.
    """
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise InvalidArgument("cache_salt must be a non-empty string when set")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt has {len(salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}")
    if not salt.isascii():
        try:
            salt.encode("utf-8")
        except UnicodeEncodeError as exc:
            message = f"cache_salt is not valid Unicode: a lone surrogate at character {exc.start}"
            raise InvalidArgument(message) from None


def salted_root(root: BlockHash, cache_salt: str) -> BlockHash:
    """The chain root of requests carrying ``cache_salt`` (the root itself for "").

    Requests with different salts get different chains for the same tokens, so
    they never share cached prefix blocks: not in an executor's prefix cache, not
    in the scheduler's prefix index, not in the kvstore (whose keys are chain
    hashes). With ``--prefix-cache-scope tenant`` the salt is the tenant's name,
    which closes the timing side channel of a shared prefix cache (a tenant
    cannot probe whether another sent a prompt); a request's own ``cache_salt``
    closes it between the users of one tenant (``cache_salt``). Source: vLLM's
    ``cache_salt``.
    """
    return root if not cache_salt else _digest_fields("meshserve-cache-salt-v1", root, cache_salt)


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
                         adapter: str = "", cache_salt: str = "") -> list[bytes]:
    """The chain of a prompt's full blocks, in wire form (what the gateway sends for routing).

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per block (>= 1); the executors' ``block_size``.
        model_id, revision, adapter: the model identity (as ``ModelFingerprint``).
        cache_salt: the request's salt (``salted_root``), as the executor applies it.

    Returns:
        One 16-byte hash per full block; the hashes under which an executor serving
        that model (in any dtype) caches, reports (``executor.kv_events``) and
        stores in the kvstore the same tokens.
    """
    root = salted_root(ModelFingerprint(model_id, revision, adapter).root_hash, cache_salt)
    return [hash_to_bytes(h) for h in hash_full_blocks(token_ids, block_size, root)]
