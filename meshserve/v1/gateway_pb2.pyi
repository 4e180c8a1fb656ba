from meshserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_QUEUED: _ClassVar[TaskState]
    TASK_STATE_RUNNING: _ClassVar[TaskState]
    TASK_STATE_SUCCEEDED: _ClassVar[TaskState]
    TASK_STATE_FAILED: _ClassVar[TaskState]
    TASK_STATE_CANCELLED: _ClassVar[TaskState]

class CallbackState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CALLBACK_STATE_UNSPECIFIED: _ClassVar[CallbackState]
    CALLBACK_STATE_PENDING: _ClassVar[CallbackState]
    CALLBACK_STATE_DELIVERED: _ClassVar[CallbackState]
    CALLBACK_STATE_FAILED: _ClassVar[CallbackState]
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_QUEUED: TaskState
TASK_STATE_RUNNING: TaskState
TASK_STATE_SUCCEEDED: TaskState
TASK_STATE_FAILED: TaskState
TASK_STATE_CANCELLED: TaskState
CALLBACK_STATE_UNSPECIFIED: CallbackState
CALLBACK_STATE_PENDING: CallbackState
CALLBACK_STATE_DELIVERED: CallbackState
CALLBACK_STATE_FAILED: CallbackState

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "prompt_token_ids", "sampling", "priority", "request_id", "callback_url", "model", "include_stop_str_in_output", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CALLBACK_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    prompt_token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    priority: int
    request_id: str
    callback_url: str
    model: str
    include_stop_str_in_output: bool
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., callback_url: _Optional[str] = ..., model: _Optional[str] = ..., include_stop_str_in_output: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class QueueUpdate(_message.Message):
    __slots__ = ("position", "estimated_wait_s")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    position: int
    estimated_wait_s: float
    def __init__(self, position: _Optional[int] = ..., estimated_wait_s: _Optional[float] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("text", "token_ids", "index", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("request_id", "finish_reason", "usage", "timings", "prompt_token_ids", "executor_id", "stop_reason", "index", "prompt_logprobs", "cached", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    executor_id: str
    stop_reason: str
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    cached: bool
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., executor_id: _Optional[str] = ..., stop_reason: _Optional[str] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., cached: _Optional[bool] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("queue", "delta", "result")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    queue: QueueUpdate
    delta: TokenDelta
    result: GenerateResult
    def __init__(self, queue: _Optional[_Union[QueueUpdate, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ...) -> None: ...

class TaskHandle(_message.Message):
    __slots__ = ("task_id", "state")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    state: TaskState
    def __init__(self, task_id: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ...) -> None: ...

class TaskQuery(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class TaskChoice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "result")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    result: GenerateResult
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ...) -> None: ...

class TaskError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("task_id", "state", "choices", "error", "created_at_unix_s", "started_at_unix_s", "finished_at_unix_s", "request_id", "queue_position", "estimated_wait_s", "attempt", "last_error", "callback", "tenant")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    CALLBACK_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    state: TaskState
    choices: _containers.RepeatedCompositeFieldContainer[TaskChoice]
    error: TaskError
    created_at_unix_s: float
    started_at_unix_s: float
    finished_at_unix_s: float
    request_id: str
    queue_position: int
    estimated_wait_s: float
    attempt: int
    last_error: str
    callback: CallbackDelivery
    tenant: str
    def __init__(self, task_id: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ..., choices: _Optional[_Iterable[_Union[TaskChoice, _Mapping]]] = ..., error: _Optional[_Union[TaskError, _Mapping]] = ..., created_at_unix_s: _Optional[float] = ..., started_at_unix_s: _Optional[float] = ..., finished_at_unix_s: _Optional[float] = ..., request_id: _Optional[str] = ..., queue_position: _Optional[int] = ..., estimated_wait_s: _Optional[float] = ..., attempt: _Optional[int] = ..., last_error: _Optional[str] = ..., callback: _Optional[_Union[CallbackDelivery, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class CallbackDelivery(_message.Message):
    __slots__ = ("url", "state", "attempts", "error")
    URL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    url: str
    state: CallbackState
    attempts: int
    error: str
    def __init__(self, url: _Optional[str] = ..., state: _Optional[_Union[CallbackState, str]] = ..., attempts: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "root", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    root: str
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., root: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...
