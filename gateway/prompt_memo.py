"""Remembers the token ids of recent prompts, so a repeated prompt (a result-cache
hit, a client retrying, a benchmark) is neither templated nor tokenized again.

Building a prompt's ids (``gateway.prompt.PromptBuilder``) is a pure function
of the prompt (the raw text, or the chat messages with their ``ChatOptions``) for a given tokenizer and
chat template, which a gateway never changes while it runs; so its output can be
reused as is. Only prompts of at most ``max_chars`` characters are remembered
(a long prompt is rare to repeat and costly to keep), at most ``max_entries``
of them, least recently used first out. A lookup is a dict access on the event
loop; a miss is built in a worker thread (``GatewayCore.prepare_async``). Token
id prompts are not remembered (they only need a range check).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from gateway.prompt import PromptBuilder
from gateway.request import GenerationRequest


class PromptMemo:
    """An LRU of prompt → token ids over a ``PromptBuilder``.

    Args:
        builder: builds (and validates) the ids of a prompt not remembered.
        max_entries: prompts remembered at most (0: none).
        max_chars: the longest prompt remembered (characters, all messages together).
    """

    def __init__(self, builder: PromptBuilder, max_entries: int = 4096, max_chars: int = 8192):
        self.builder, self.max_entries, self.max_chars = builder, max_entries, max_chars
        self._ids: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()  # builds run in worker threads
        self.hits = 0

    def _key(self, request: GenerationRequest) -> tuple | None:
        if self.max_entries <= 0 or len(request.input_kinds) != 1:
            return None
        if request.prompt is not None and len(request.prompt) <= self.max_chars:
            return ("prompt", request.prompt)
        options = request.chat_options
        if (request.chat is not None and all(isinstance(c, str) for _, c in request.chat)
                and sum(len(r) + len(c) for r, c in request.chat) + len(options.template_kwargs)
                + sum(len(n) for n in options.names if n is not None) <= self.max_chars):
            return ("chat", tuple(request.chat), options)  # the same messages rendered otherwise are another prompt
        return None

    def lookup(self, request: GenerationRequest) -> list[int] | None:
        """The remembered ids of the request's prompt, or None."""
        key = self._key(request)
        if key is None:
            return None
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                return None
            self._ids.move_to_end(key)
            self.hits += 1
        return list(ids)

    def build(self, request: GenerationRequest) -> list[int]:
        """``builder.from_request(request)``, remembered when the prompt is short enough.

        Raises:
            InvalidArgument: as ``PromptBuilder.from_request`` (nothing is remembered).
        """
        ids = self.builder.from_request(request)
        key = self._key(request)
        if key is not None:
            with self._lock:
                self._ids[key] = tuple(ids)
                self._ids.move_to_end(key)
                while len(self._ids) > self.max_entries:
                    self._ids.popitem(last=False)
        return ids
