from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "priority", "num_prompt_tokens", "max_tokens", "model", "n", "block_hashes", "hash_block_size", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    priority: int
    num_prompt_tokens: int
    max_tokens: int
    model: str
    n: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    hash_block_size: int
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., model: _Optional[str] = ..., n: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., hash_block_size: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class AdmitQueued(_message.Message):
    __slots__ = ("position", "estimated_wait_s")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    position: int
    estimated_wait_s: float
    def __init__(self, position: _Optional[int] = ..., estimated_wait_s: _Optional[float] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("executor_id", "address", "lease_id", "queue_s", "lease", "lease_ttl_s")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    address: str
    lease_id: str
    queue_s: float
    lease: bytes
    lease_ttl_s: float
    def __init__(self, executor_id: _Optional[str] = ..., address: _Optional[str] = ..., lease_id: _Optional[str] = ..., queue_s: _Optional[float] = ..., lease: _Optional[bytes] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class AdmitEvent(_message.Message):
    __slots__ = ("queued", "assignment")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    queued: AdmitQueued
    assignment: Assignment
    def __init__(self, queued: _Optional[_Union[AdmitQueued, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "num_completion_tokens", "num_generated_tokens")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    num_completion_tokens: int
    num_generated_tokens: int
    def __init__(self, lease_id: _Optional[str] = ..., num_completion_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorRegister(_message.Message):
    __slots__ = ("executor_id", "address", "model", "num_blocks", "block_size", "max_model_len", "pool", "kvstore_namespace", "startup_s")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    address: str
    model: str
    num_blocks: int
    block_size: int
    max_model_len: int
    pool: str
    kvstore_namespace: bytes
    startup_s: float
    def __init__(self, executor_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., pool: _Optional[str] = ..., kvstore_namespace: _Optional[bytes] = ..., startup_s: _Optional[float] = ...) -> None: ...

class CapacityReport(_message.Message):
    __slots__ = ("num_free_blocks", "num_running", "num_waiting", "lease_ids", "lease_num_blocks")
    class LeaseNumBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    num_running: int
    num_waiting: int
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_num_blocks: _containers.ScalarMap[str, int]
    def __init__(self, num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., lease_ids: _Optional[_Iterable[str]] = ..., lease_num_blocks: _Optional[_Mapping[str, int]] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("reset", "stored", "removed")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExecutorMessage(_message.Message):
    __slots__ = ("register", "capacity", "kv_events", "draining")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    register: ExecutorRegister
    capacity: CapacityReport
    kv_events: KvEvents
    draining: ExecutorDraining
    def __init__(self, register: _Optional[_Union[ExecutorRegister, _Mapping]] = ..., capacity: _Optional[_Union[CapacityReport, _Mapping]] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ..., draining: _Optional[_Union[ExecutorDraining, _Mapping]] = ...) -> None: ...

class RegisterAck(_message.Message):
    __slots__ = ("executor_id", "lease_public_key")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    lease_public_key: bytes
    def __init__(self, executor_id: _Optional[str] = ..., lease_public_key: _Optional[bytes] = ...) -> None: ...

class SchedulerCommand(_message.Message):
    __slots__ = ("registered", "drain_ack")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ACK_FIELD_NUMBER: _ClassVar[int]
    registered: RegisterAck
    drain_ack: DrainAck
    def __init__(self, registered: _Optional[_Union[RegisterAck, _Mapping]] = ..., drain_ack: _Optional[_Union[DrainAck, _Mapping]] = ...) -> None: ...

class LeaseClaims(_message.Message):
    __slots__ = ("lease_id", "request_id", "tenant", "executor_id", "num_blocks", "expires_at_unix_s", "nonce", "priority", "max_tokens")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    tenant: str
    executor_id: str
    num_blocks: int
    expires_at_unix_s: float
    nonce: bytes
    priority: int
    max_tokens: int
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., executor_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., expires_at_unix_s: _Optional[float] = ..., nonce: _Optional[bytes] = ..., priority: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class SignedLease(_message.Message):
    __slots__ = ("claims", "signature")
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    claims: bytes
    signature: bytes
    def __init__(self, claims: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("expires_in_s",)
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    expires_in_s: float
    def __init__(self, expires_in_s: _Optional[float] = ...) -> None: ...

class ExecutorDraining(_message.Message):
    __slots__ = ("grace_s",)
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    def __init__(self, grace_s: _Optional[float] = ...) -> None: ...

class DrainAck(_message.Message):
    __slots__ = ("executor_id", "done")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    done: bool
    def __init__(self, executor_id: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...
