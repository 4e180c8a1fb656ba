from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlacementKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_KIND_UNSPECIFIED: _ClassVar[PlacementKind]
    PLACEMENT_KIND_STORED: _ClassVar[PlacementKind]
    PLACEMENT_KIND_MOVED: _ClassVar[PlacementKind]
    PLACEMENT_KIND_REMOVED: _ClassVar[PlacementKind]
    PLACEMENT_KIND_SNAPSHOT_END: _ClassVar[PlacementKind]
PLACEMENT_KIND_UNSPECIFIED: PlacementKind
PLACEMENT_KIND_STORED: PlacementKind
PLACEMENT_KIND_MOVED: PlacementKind
PLACEMENT_KIND_REMOVED: PlacementKind
PLACEMENT_KIND_SNAPSHOT_END: PlacementKind

class KVFingerprint(_message.Message):
    __slots__ = ("model_id", "revision", "dtype", "adapter", "block_size", "num_layers", "num_kv_heads", "head_dim", "tp_rank", "tp_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    revision: str
    dtype: str
    adapter: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    def __init__(self, model_id: _Optional[str] = ..., revision: _Optional[str] = ..., dtype: _Optional[str] = ..., adapter: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("fingerprint", "block_hashes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: KVFingerprint
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, fingerprint: _Optional[_Union[KVFingerprint, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("fingerprint", "block_hashes", "lease_owner")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    fingerprint: KVFingerprint
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_owner: str
    def __init__(self, fingerprint: _Optional[_Union[KVFingerprint, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., lease_owner: _Optional[str] = ...) -> None: ...

class BlockHeader(_message.Message):
    __slots__ = ("block_hash", "num_bytes", "checksum")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    num_bytes: int
    checksum: int
    def __init__(self, block_hash: _Optional[bytes] = ..., num_bytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("num_blocks", "header", "data")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    header: BlockHeader
    data: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("fingerprint", "header", "data")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    fingerprint: KVFingerprint
    header: BlockHeader
    data: bytes
    def __init__(self, fingerprint: _Optional[_Union[KVFingerprint, _Mapping]] = ..., header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_existing", "num_no_space")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTING_FIELD_NUMBER: _ClassVar[int]
    NUM_NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_existing: int
    num_no_space: int
    def __init__(self, num_stored: _Optional[int] = ..., num_existing: _Optional[int] = ..., num_no_space: _Optional[int] = ...) -> None: ...

class KVStoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreStatsResponse(_message.Message):
    __slots__ = ("memory_capacity_bytes", "memory_used_bytes", "memory_blocks", "disk_capacity_bytes", "disk_used_bytes", "disk_blocks", "hit_blocks", "miss_blocks", "bytes_in", "bytes_out", "blocks_stored", "memory_evictions", "disk_evictions", "blocks_removed", "rejected_no_space", "corrupt_blocks", "num_leases", "num_lease_owners", "placement_cursor")
    MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASE_OWNERS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    memory_capacity_bytes: int
    memory_used_bytes: int
    memory_blocks: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    disk_blocks: int
    hit_blocks: int
    miss_blocks: int
    bytes_in: int
    bytes_out: int
    blocks_stored: int
    memory_evictions: int
    disk_evictions: int
    blocks_removed: int
    rejected_no_space: int
    corrupt_blocks: int
    num_leases: int
    num_lease_owners: int
    placement_cursor: int
    def __init__(self, memory_capacity_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_blocks: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., memory_evictions: _Optional[int] = ..., disk_evictions: _Optional[int] = ..., blocks_removed: _Optional[int] = ..., rejected_no_space: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_lease_owners: _Optional[int] = ..., placement_cursor: _Optional[int] = ...) -> None: ...

class WatchPlacementsRequest(_message.Message):
    __slots__ = ("cursor",)
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    def __init__(self, cursor: _Optional[int] = ...) -> None: ...

class PlacementEvent(_message.Message):
    __slots__ = ("seq", "kind", "namespace", "block_hash", "tier", "snapshot")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: PlacementKind
    namespace: bytes
    block_hash: bytes
    tier: str
    snapshot: bool
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[PlacementKind, str]] = ..., namespace: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ..., tier: _Optional[str] = ..., snapshot: _Optional[bool] = ...) -> None: ...
