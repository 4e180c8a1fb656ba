"""Prompt size limits, checked before anything is tokenized or rendered.

Tokenizing costs time and memory in proportion to the prompt, so the gateway
first bounds what it will look at, cheaply, on the event loop:

* ``max_prompt_bytes``: UTF-8 bytes of a raw prompt, or of all chat message
  contents, names and template kwargs together (default 256 KiB: about 64,000 tokens of English text; a
  16 MB prompt is refused here, in microseconds, instead of being tokenized for
  seconds; raise it for models whose context is longer);
* ``max_messages``: chat messages (default 1,024);
* prompt token ids: at most ``max_model_len - 1`` (room for one output token),
  counted before each id is range-checked.

Each refusal is ``InvalidArgument`` naming the field and its cap. What passes
is tokenized off the event loop (``GatewayCore.prepare_async``), in a worker
thread: the fast tokenizer releases the GIL while it encodes, so a prompt at
the cap stalls the loop for tens of milliseconds at most (measured by
``tests/gateway/test_prompt_limits.py``). The stalls grow with the prompt (the
tokenizer holds the GIL for part of its work): measured on a loaded 2-core
machine, about 6 ms at 64 KiB, 15-25 ms at 256 KiB, 30-110 ms at 1 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.request import GenerationRequest
from meshserve.errors import InvalidArgument


@dataclass(frozen=True)
class PromptLimits:
    """Caps on a prompt's size.

    Attributes:
        max_prompt_bytes: UTF-8 bytes of the prompt text or of all chat contents (bytes).
        max_messages: chat messages.
    """

    max_prompt_bytes: int = 256 << 10
    max_messages: int = 1024

    def __post_init__(self) -> None:
        if self.max_prompt_bytes < 1 or self.max_messages < 1:
            raise ValueError("max_prompt_bytes and max_messages must be >= 1")

    def check(self, request: GenerationRequest, max_model_len: int) -> None:
        """Raises ``InvalidArgument`` when the request's prompt is over a cap or is not
        valid Unicode (a lone surrogate, which JSON can carry and UTF-8 cannot), naming
        the message (``chat.messages[3].content``) that holds it."""
        if request.prompt is not None:
            self._check_bytes("prompt", [("prompt", request.prompt)])
        if request.chat is not None:
            if len(request.chat) > self.max_messages:
                raise InvalidArgument(f"chat.messages has {len(request.chat)} messages; the limit is "
                                      f"{self.max_messages}")
            options = request.chat_options  # names and template variables are rendered too: counted with the contents
            self._check_bytes("chat.messages", [
                *((f"chat.messages[{i}].content", c) for i, (_, c) in enumerate(request.chat) if isinstance(c, str)),
                *((f"chat.messages[{i}].name", n) for i, n in enumerate(options.names) if isinstance(n, str)),
                *([("chat_template_kwargs", options.template_kwargs)] if options.template_kwargs else [])])
        if request.prompt_token_ids is not None and len(request.prompt_token_ids) >= max_model_len:
            raise InvalidArgument(f"prompt has {len(request.prompt_token_ids)} tokens; max_model_len is "
                                  f"{max_model_len} (prompt + at least 1 output token)")

    def _check_bytes(self, field: str, texts: list[tuple[str, str]]) -> None:
        over = f"{field} is over the limit of {self.max_prompt_bytes} bytes (UTF-8)"
        if sum(len(t) for _, t in texts) > self.max_prompt_bytes:  # a character is 1 to 4 UTF-8 bytes
            raise InvalidArgument(over)
        size = 0
        for name, text in texts:  # encoded once: its size, and JSON's lone surrogates ("\ud800") no tokenizer takes
            if text.isascii():
                size += len(text)
                continue
            try:
                size += len(text.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise not_unicode(name, exc) from None
        if size > self.max_prompt_bytes:
            raise InvalidArgument(over)


def not_unicode(name: str, exc: UnicodeEncodeError) -> InvalidArgument:
    """The refusal of a text holding a lone surrogate, naming it and the character."""
    return InvalidArgument(f"{name} is not valid Unicode: a lone surrogate at character {exc.start}")
