"""Prompt building: raw text, chat messages or token ids -> validated token ids.

Policies (tested in tests/gateway/test_prompt.py):

* **Raw text** (``from_text``): the caller owns the format. The text is encoded
  as ``tokenizer(text)`` does (the vLLM and Hugging Face default): special-token
  text such as ``<|im_start|>`` IS parsed as the control token, and the
  tokenizer's post-processor adds what it adds by default. SmolLM2's adds
  nothing (no BOS); a Llama-2-style tokenizer prepends its BOS.
* **Chat** (``from_chat``): the model's chat template is rendered with
  ``add_generation_prompt=True``. Control tokens come only from the template:
  text a user types inside a message, such as ``<|im_end|>``, is encoded as
  ordinary text. When no content holds control-token text the ids
  equal the plain ``apply_chat_template(..., tokenize=True)`` exactly.
  ``ChatOptions`` (vLLM's chat extras) change the rendering as transformers'
  ``apply_chat_template`` does with the same arguments: ``add_generation_prompt``
  False ends after the last message; ``continue_final_message`` (which needs
  ``add_generation_prompt`` False and a final assistant message) cuts the rendering
  right after that message's content, so the model continues it; the template
  kwargs are extra template variables (any but ``apply_chat_template``'s own
  parameters and ``messages``, which are refused); a message's ``name`` is its
  ``name`` key.
* **Token ids** (``from_token_ids``): taken as given after a range check.

``from_request`` picks the form a ``GenerationRequest`` (``gateway.request``) sets.

Every form rejects an empty prompt.

Chat encodes user text as ordinary text with the mechanism ``transformers``
keeps for it (>= 5.x),
``apply_chat_template(..., sanitize_control_tokens=True)``: control-token text in
the messages is wrapped in private-use markers (U+F0000 / U+F0001) before
rendering, so it stays recognisable whatever the template does with the content
(strip it, repeat it); the rendering is then split at the markers and marked
tokens are encoded as plain text. Control tokens are the tokenizer's special
tokens plus added tokens written in the template. A user's own U+F0000 / U+F0001
characters are dropped.

Thread safety: a ``transformers`` tokenizer implements ``split_special_tokens``
by toggling a flag on the shared Rust tokenizer, so two threads encoding at once
could encode a user's ``<|im_end|>`` as the control token. Every encode here
holds one lock; encode with this tokenizer only through a ``PromptBuilder``.
"""

from __future__ import annotations

import inspect
import json
import threading
from typing import TYPE_CHECKING, Any, Sequence

import jinja2

from gateway.prompt_limits import not_unicode
from gateway.request import ChatOptions
from meshserve.errors import InvalidArgument

if TYPE_CHECKING:
    from gateway.request import GenerationRequest

ROLES = ("system", "user", "assistant", "developer")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role (its o1 and later models)
# ``chat_template_kwargs``: how deep its values nest (the chat template's rendering walks them
# recursively: a few hundred levels exhaust Python's recursion limit)
MAX_TEMPLATE_KWARGS_DEPTH = 32
_TOO_DEEP = f"nests deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels of objects and arrays"


def json_depth(value: Any) -> int:
    """How deep ``value`` (a JSON value) nests: 0 for a scalar, 1 for ``{}`` or ``[]``
    of scalars… Counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in value)
    return deepest


def check_template_kwargs_depth(kwargs: dict[str, Any]) -> None:
    """Raises ``ValueError`` (the message names no field: each adapter names it as its
    request spells it) when ``kwargs`` nest deeper than ``MAX_TEMPLATE_KWARGS_DEPTH``."""
    if json_depth(kwargs) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise ValueError(_TOO_DEEP)


def template_kwargs_text(kwargs: dict[str, Any] | None) -> str:
    """``chat_template_kwargs`` as ``ChatOptions.template_kwargs``: JSON with sorted keys,
    so the same variables are one prompt (``gateway.prompt_memo``); "" for none or ``{}``."""
    return json.dumps(kwargs, ensure_ascii=False, sort_keys=True) if kwargs else ""


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """``ChatOptions.template_kwargs`` (the text of a JSON object: the HTTP body's object
    as ``template_kwargs_text`` wrote it, or the gRPC request's text as sent) as the
    template's variables ({} for "").

    Raises:
        InvalidArgument: not JSON, not an object, nested deeper than
            ``MAX_TEMPLATE_KWARGS_DEPTH``, or holding a lone surrogate (an escape such as
            ``\\ud800``, which JSON text spells in ASCII; the last three with the HTTP body's
            messages: the character is counted in ``template_kwargs_text`` of the object).
    """
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"chat_template_kwargs is not valid JSON: {exc.msg} (line {exc.lineno}, column "
                              f"{exc.colno})") from None
    except RecursionError:  # deeper than the parser goes, so deeper than the cap
        raise InvalidArgument(f"chat_template_kwargs: {_TOO_DEEP}") from None
    except ValueError as exc:  # Python's cap on the digits of an int it converts
        raise InvalidArgument(f"chat_template_kwargs is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument("chat_template_kwargs: Input should be an object")
    try:
        check_template_kwargs_depth(kwargs)
    except ValueError as exc:
        raise InvalidArgument(f"chat_template_kwargs: {exc}") from None
    if "\\u" in text:  # only an escape can carry a lone surrogate here: a raw one was refused with the text
        try:
            template_kwargs_text(kwargs).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise not_unicode("chat_template_kwargs", exc) from None
    return kwargs


class PromptBuilder:
    """Builds prompt token ids for one model.

    Args:
        tokenizer: the model's ``transformers`` tokenizer (a fast tokenizer).
        vocab_size: ids accepted by ``from_token_ids`` are ``[0, vocab_size)``;
            default ``len(tokenizer)`` (base vocabulary plus added tokens).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.special_token_ids: frozenset[int] = frozenset(tokenizer.all_special_ids) | added
        # template kwargs that would not reach the template as variables: apply_chat_template's own
        # parameters (``tokenize``, ``return_dict``…, and ``self``, which a bound method's signature
        # leaves out) and what it passes itself (``messages``)
        own = inspect.signature(tokenizer.apply_chat_template).parameters
        self.reserved_template_kwargs: frozenset[str] = frozenset(
            name for name, p in own.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) | {"messages", "self"}
        self._lock = threading.Lock()

    def from_request(self, request: GenerationRequest) -> list[int]:
        """The prompt ids of the one prompt form ``request`` sets.

        Raises:
            InvalidArgument: none or several forms set, or as the form's own method.
        """
        kinds = request.input_kinds
        if len(kinds) > 1:
            raise InvalidArgument(f"only one of prompt, chat or prompt_token_ids may be set, got {', '.join(kinds)}")
        if request.prompt is not None:
            return self.from_text(request.prompt)
        if request.chat is not None:
            return self.from_chat(request.chat, request.chat_options)
        if request.prompt_token_ids is not None:
            return self.from_token_ids(request.prompt_token_ids)
        raise InvalidArgument("one of prompt, chat or prompt_token_ids must be set")

    def from_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encodes a raw prompt (special-token text parsed; see the module policy).
        ``add_special_tokens`` False leaves out what the tokenizer's post-processor adds
        (a BOS…): ``POST /tokenize``'s option; a prompt that runs always has them.

        Raises:
            InvalidArgument: empty ``prompt``.
        """
        if not text:
            raise InvalidArgument("prompt must not be empty")
        ids = self.tokenize(text, add_special_tokens)
        if not ids:
            raise InvalidArgument("prompt encodes to no tokens")
        return ids

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of a raw prompt as ``from_text`` encodes it, none refused: ``POST
        /tokenize`` counts an empty prompt (``[]``, or what the post-processor adds),
        as vLLM's does."""
        with self._lock:
            return list(self.tokenizer(text, split_special_tokens=False,
                                       add_special_tokens=add_special_tokens)["input_ids"])

    def from_token_ids(self, ids: Sequence[int]) -> list[int]:
        """Checks pre-tokenized prompt ids.

        Raises:
            InvalidArgument: empty ``prompt_token_ids``, or an id outside
                ``[0, vocab_size)`` (names the first bad index).
        """
        if len(ids) == 0:
            raise InvalidArgument("prompt_token_ids must not be empty")
        for j, tid in enumerate(ids):
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < self.vocab_size:
                raise InvalidArgument(
                    f"prompt_token_ids[{j}] = {tid!r} is outside the vocabulary [0, {self.vocab_size})"
                )
        return list(ids)

    def from_chat(self, messages: Sequence[tuple[str, str]], options: ChatOptions = ChatOptions()) -> list[int]:
        """Renders a conversation with the chat template, by default plus the
        generation prompt; user-typed control-token text stays text (see the module
        docstring).

        Args:
            messages: (role, content) pairs; role in ``ROLES``.
            options: how to render them (``ChatOptions``: the generation prompt,
                continuing the final message, template variables, message names).

        Raises:
            InvalidArgument: no messages, an unknown role, a non-string content,
                a model without a chat template, options that contradict each other
                or the messages, a template kwarg that is not a template variable, or
                one the template fails on (a number where it adds strings…), or an
                error raised by the template itself (e.g. roles that do not alternate).
        """
        self._check_messages(messages)
        variables = self._check_options(messages, options)
        conversation = [{"role": ROLE_ALIASES.get(role, role), "content": content} for role, content in messages]
        for message, name in zip(conversation, options.names):
            if name is not None:
                message["name"] = name
        try:
            with self._lock:
                ids = self.tokenizer.apply_chat_template(
                    conversation,
                    add_generation_prompt=options.add_generation_prompt,
                    continue_final_message=options.continue_final_message,
                    tokenize=True,
                    return_dict=False,
                    sanitize_control_tokens=True,
                    **variables,
                )
        except jinja2.TemplateError as exc:  # includes the template's raise_exception()
            raise InvalidArgument(f"chat.messages: the model's chat template refused them: {exc}") from exc
        except (TypeError, ValueError, ArithmeticError) as exc:
            if isinstance(exc, ValueError) and options.continue_final_message:  # transformers: the final message
                raise InvalidArgument(  # is not in the rendering as sent
                    f"continue_final_message: the chat template does not render the final message so that it can "
                    f"be continued: {str(exc).splitlines()[0]}") from exc
            if not variables:  # the messages are strings: the template's own fault
                raise
            raise InvalidArgument(f"chat_template_kwargs: the model's chat template failed with them: "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        if not ids:
            raise InvalidArgument("chat.messages render to an empty prompt")
        return list(ids)

    def _check_options(self, messages: Sequence[tuple[str, str]], options: ChatOptions) -> dict[str, Any]:
        """The template variables of ``options``, after checking them against each other and ``messages``."""
        if options.continue_final_message:
            if options.add_generation_prompt:
                raise InvalidArgument("continue_final_message cannot be used with add_generation_prompt: true "
                                      "(set add_generation_prompt to false)")
            if messages[-1][0] != "assistant":
                raise InvalidArgument(f"continue_final_message needs the last message to be the assistant's, got "
                                      f"role {messages[-1][0]!r}")
        if len(options.names) not in (0, len(messages)):
            raise InvalidArgument(f"chat.messages: {len(options.names)} names for {len(messages)} messages")
        variables = parse_template_kwargs(options.template_kwargs)
        for key in variables:
            if key in self.reserved_template_kwargs:
                raise InvalidArgument(f"chat_template_kwargs.{key} is not a template variable meshserve passes on "
                                      "(it is a parameter of the rendering itself, or the messages)")
        return variables

    def _check_messages(self, messages: Sequence[tuple[str, str]]) -> None:
        if not messages:
            raise InvalidArgument("chat.messages must not be empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("this model has no chat template: send a raw prompt instead of chat messages")
        for i, (role, content) in enumerate(messages):
            if role not in ROLES:
                raise InvalidArgument(f"chat.messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise InvalidArgument(f"chat.messages[{i}].content must be a string")
