"""Span attribute names and the GenAI semantic-convention mapping, in one place.

Names under ``gen_ai.*`` are the OpenTelemetry GenAI semantic conventions
(https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/; written out
here rather than imported from ``opentelemetry.semconv._incubating``, whose
names still move). The gateway's request span is named after the convention:
``"{gen_ai.operation.name} {gen_ai.request.model}"`` (``chat smollm2-135m-instruct``).
Everything that is ours is under ``meshserve.*``. docs/operations.md (Tracing)
lists every span and attribute.
"""

from __future__ import annotations

from meshserve.sampling import SamplingParams

# GenAI semantic conventions
OPERATION_NAME = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
REQUEST_STREAM = "gen_ai.request.stream"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

# ours
REQUEST_ID = "meshserve.request_id"
TENANT = "meshserve.tenant"
PRIORITY = "meshserve.priority"
EXECUTOR_ID = "meshserve.executor_id"
QUEUE_POSITION = "meshserve.queue.position"
QUEUE_WAIT_S = "meshserve.queue.wait_s"
PREFIX_CACHE_HIT_TOKENS = "meshserve.prefix_cache.hit_tokens"
KVSTORE_HIT_TOKENS = "meshserve.kvstore.hit_tokens"
PREEMPTIONS = "meshserve.preemptions"
PREFILL_S = "meshserve.prefill_s"
DECODE_S = "meshserve.decode_s"
RESULT_CACHE_HIT = "meshserve.result_cache.hit"
TASK_ID = "meshserve.task_id"
TASK_STATE = "meshserve.task.state"

# span names of the async task API (the task's generation is a request span as Generate's)
SPAN_SUBMIT_TASK = "gateway.submit_task"
SPAN_GET_TASK = "gateway.get_task"
SPAN_CANCEL_TASK = "gateway.cancel_task"

# events
EVENT_FIRST_TOKEN = "first_token"
EVENT_PREEMPTED = "meshserve.preempted"

# gen_ai.operation.name by the GenerateRequest's input kind
_OPERATIONS = {"chat": "chat", "prompt": "text_completion", "prompt_token_ids": "text_completion"}

# gen_ai.response.finish_reasons values by common.proto FinishReason number
_FINISH_REASONS = {1: "stop", 2: "length", 3: "abort"}


def operation_name(input_kind: str | None) -> str:
    """``gen_ai.operation.name`` of a GenerateRequest whose ``input`` oneof is
    ``input_kind`` (``chat`` → ``chat``; ``prompt``/``prompt_token_ids`` →
    ``text_completion``; unset → ``text_completion``)."""
    return _OPERATIONS.get(input_kind or "", "text_completion")


def span_name(operation: str, model: str) -> str:
    """The GenAI convention's span name: ``"{operation} {model}"``."""
    return f"{operation} {model}"


def sampling_attributes(params: SamplingParams) -> dict[str, object]:
    """The ``gen_ai.request.*`` attributes of validated sampling parameters
    (``top_k`` and ``seed`` only when set)."""
    attrs: dict[str, object] = {
        REQUEST_MAX_TOKENS: params.max_tokens,
        REQUEST_TEMPERATURE: params.temperature,
        REQUEST_TOP_P: params.top_p,
        REQUEST_CHOICE_COUNT: params.n,
    }
    if params.top_k:
        attrs[REQUEST_TOP_K] = params.top_k
    if params.seed is not None:
        attrs[REQUEST_SEED] = params.seed
    return attrs


def finish_reasons(reasons: list[int | str | None]) -> list[str]:
    """``gen_ai.response.finish_reasons`` in choice order, from common.proto
    ``FinishReason`` numbers or engine strings (``stop``/``length``/``abort``);
    an unfinished choice is ``"unfinished"``."""
    out = []
    for reason in reasons:
        if isinstance(reason, int):
            reason = _FINISH_REASONS.get(reason)
        out.append(reason or "unfinished")
    return out
