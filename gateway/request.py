"""The plain data a request goes through in the gateway core: what an adapter hands
in (``GenerationRequest``, ``SpanOptions``), what the core serves (``ModelInfo``) and
what ``GatewayCore.prepare`` gives back (``Prepared``). No protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from gateway.choices import RequestTimer
from gateway.metrics import RequestMetrics
from meshserve.errors import ModelNotFound
from meshserve.sampling import SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows of the model it fronts.

    Attributes:
        model_id: the model id executors register with.
        max_model_len: longest prompt + output (tokens).
        vocab_size: token ids are in [0, vocab_size).
        revision: the weights' revision (``meshserve.model_files``); with the
            model id it roots the prompt's routing chain hashes, so it must be
            the executors' (both resolve the same model files).
        served_model_names: the names callers may pass as ``model``
            (``--served-model-name``, as vLLM spells it); empty: the model id.
        eos_token_ids: every id the executors end a generation on unless
            ``ignore_eos`` (``meshserve.model_files.eos_token_ids``); those other than
            the tokenizer's own EOS are reported as a choice's stop token, as vLLM
            adds them to ``stop_token_ids``.
    """

    model_id: str
    max_model_len: int
    vocab_size: int
    revision: str = ""
    served_model_names: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may take; the first is the one responses carry."""
        return self.served_model_names or (self.model_id,)

    def check_served(self, name: str) -> None:
        """Checks that ``name`` is one of ``names``.

        Raises:
            ModelNotFound: it is not (the message lists the served names).
        """
        if name not in self.names:
            raise ModelNotFound(f"model {name!r} is not served here (this gateway serves "
                                f"{', '.join(map(repr, self.names))})")


@dataclass(frozen=True)
class ChatOptions:
    """How a chat's messages are rendered (``gateway.prompt``), beyond the messages
    themselves: vLLM's chat extras. Hashable (the prompt memo keys on it).

    Attributes:
        add_generation_prompt: end the prompt with the template's assistant header,
            so the model answers in a new message (the default).
        continue_final_message: end the prompt right after the final message's
            content (which must be the assistant's), so the model continues that
            message; needs ``add_generation_prompt`` False (transformers' semantics).
        template_kwargs: extra variables of the chat template, as the text of a JSON
            object ("": none); ``gateway.prompt`` parses it (and refuses text that is not
            a JSON object).
        names: each message's ``name`` by position (None: it has none); (): no
            message has one (names of None only are stored as ()). The template sees it
            as the message's ``name`` key.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: str = ""
    names: tuple[str | None, ...] = ()

    def __post_init__(self):
        if not any(name is not None for name in self.names):
            object.__setattr__(self, "names", ())  # one spelling of "no names": one prompt memo key


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as a caller asked for it, before validation.

    Exactly one of ``prompt``, ``chat`` and ``prompt_token_ids`` is set (None: not
    given; an empty value is given, and rejected as empty).

    Attributes:
        prompt: raw prompt text (special-token text is parsed; ``gateway.prompt``).
        chat: (role, content) messages, rendered with the chat template.
        prompt_token_ids: prompt token ids, used as they are.
        sampling: sampling parameters as given (the core validates them).
        priority: the priority class; None: the tenant's default.
        request_id: the caller's id; "" lets the core make one.
        model: the model the caller names; None: the one this gateway serves.
        chat_options: how ``chat`` is rendered (``ChatOptions``; unused by the other forms).
        include_stop_str_in_output: a choice a stop string ended keeps that string at the
            end of its text (vLLM's; the core's text otherwise ends right before it).
        cache_salt: vLLM's: the request's prefix cache blocks are shared only with
            requests of its tenant carrying the same salt
            (``meshserve.block_hash.cache_salt``); None: no salt (an empty one is refused).
    """

    prompt: str | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int | None = None
    request_id: str = ""
    model: str | None = None
    chat_options: ChatOptions = ChatOptions()
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None

    @property
    def input_kinds(self) -> list[str]:
        """The prompt forms set, of ``prompt``, ``chat``, ``prompt_token_ids`` (one when valid)."""
        return [kind for kind in ("prompt", "chat", "prompt_token_ids") if getattr(self, kind) is not None]

    @property
    def input_kind(self) -> str | None:
        """The (first) prompt form set, or None."""
        kinds = self.input_kinds
        return kinds[0] if kinds else None


@dataclass(frozen=True)
class SpanOptions:
    """How the core traces one request (its span is ``"{operation} {model}"``).

    Attributes:
        parent: the parent context (e.g. the caller's W3C ``traceparent``; None: a new trace).
        kind: the span's kind (SERVER for a call being served, INTERNAL for a task).
        stream: the caller receives the output as a stream (``gen_ai.request.stream``).
        attributes: extra attributes of the span (e.g. the task id).
    """

    parent: otel_context.Context | None = None
    kind: trace.SpanKind = trace.SpanKind.SERVER
    stream: bool = True
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)


@dataclass(eq=False)
class Prepared:
    """A validated request that holds its request id, ready to run.

    Attributes:
        request_id: its id (claimed in the core until the request ends).
        tenant: the tenant's name.
        operation: ``chat`` or ``text_completion`` (the GenAI operation name).
        prompt_ids: the prompt's token ids.
        params: validated sampling parameters.
        priority: the priority class (the tenant's default when unset).
        metrics: its observations (``gateway.metrics``).
        timer: when it arrived, was assigned, got its first token.
        cache_key: the result-cache key; None when the cache is off or the
            request is not deterministic.
        num_generated_tokens: tokens the executor sent, all choices, also those of
            a choice a stop string had already ended (what its tenant is charged).
        include_stop_str_in_output: as ``GenerationRequest``'s (applied to the events
            after the result cache: an entry serves the request with it and without).
        cache_salt: the request's own ``cache_salt`` ("": none), checked; it salts the
            routing hashes, travels to the executor and is part of ``cache_key``.
    """

    request_id: str
    tenant: str
    operation: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    metrics: RequestMetrics
    timer: RequestTimer
    cache_key: str | None = None
    ended: bool = False
    num_generated_tokens: int = 0
    include_stop_str_in_output: bool = False
    cache_salt: str = ""
