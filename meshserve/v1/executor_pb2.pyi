from meshserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecuteRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "prompt_token_ids", "sampling", "priority", "lease", "tenant", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    lease: bytes
    tenant: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., lease: _Optional[bytes] = ..., tenant: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "num_cached_tokens", "index", "logprobs", "prompt_logprobs", "num_kvstore_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_KVSTORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    num_cached_tokens: int
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_kvstore_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_kvstore_tokens: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_blocks", "num_free_blocks", "num_running", "num_waiting", "num_steps", "num_joined_running_batch", "num_finished", "num_aborted", "block_size", "max_model_len", "model", "num_preemptions", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "kv_cache_utilization", "num_cached_free_blocks", "num_prompt_tokens", "num_generation_tokens", "kvstore_hit_tokens", "kvstore_queried_tokens", "kvstore_fetched_blocks", "kvstore_bytes_in", "kvstore_fetch_failures", "kvstore_corrupt_blocks", "kvstore_fetch_seconds", "kvstore_fetches", "kvstore_published_blocks", "kvstore_bytes_out", "kvstore_publish_dropped_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_JOINED_RUNNING_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_FETCHES_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_PUBLISH_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_joined_running_batch: int
    num_finished: int
    num_aborted: int
    block_size: int
    max_model_len: int
    model: str
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    kv_cache_utilization: float
    num_cached_free_blocks: int
    num_prompt_tokens: int
    num_generation_tokens: int
    kvstore_hit_tokens: int
    kvstore_queried_tokens: int
    kvstore_fetched_blocks: int
    kvstore_bytes_in: int
    kvstore_fetch_failures: int
    kvstore_corrupt_blocks: int
    kvstore_fetch_seconds: float
    kvstore_fetches: int
    kvstore_published_blocks: int
    kvstore_bytes_out: int
    kvstore_publish_dropped_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_joined_running_batch: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_aborted: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., model: _Optional[str] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., kv_cache_utilization: _Optional[float] = ..., num_cached_free_blocks: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generation_tokens: _Optional[int] = ..., kvstore_hit_tokens: _Optional[int] = ..., kvstore_queried_tokens: _Optional[int] = ..., kvstore_fetched_blocks: _Optional[int] = ..., kvstore_bytes_in: _Optional[int] = ..., kvstore_fetch_failures: _Optional[int] = ..., kvstore_corrupt_blocks: _Optional[int] = ..., kvstore_fetch_seconds: _Optional[float] = ..., kvstore_fetches: _Optional[int] = ..., kvstore_published_blocks: _Optional[int] = ..., kvstore_bytes_out: _Optional[int] = ..., kvstore_publish_dropped_blocks: _Optional[int] = ...) -> None: ...
