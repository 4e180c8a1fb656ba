"""Incremental, UTF-8-safe detokenization (pure core).

Tokens arrive from the executor one (or a few) at a time; the client must get
text as soon as it is final, and never half a character. A byte-level BPE token
may hold part of a multi-byte UTF-8 character ("你" is two tokens in SmolLM2,
"🚀" three), which decodes on its own to U+FFFD.

Algorithm (vLLM's ``detokenize_incrementally``, prefix_offset / read_offset):
keep a small window of token ids ``ids[prefix_offset:]`` where
``ids[prefix_offset:read_offset]`` has already been emitted and ends on a
character boundary. Each ``add`` decodes the window once; if the text grew and
does not end in U+FFFD (an incomplete character, or one that a later token may
still complete), the new part is final: emit it and slide the window so it
starts at the old ``read_offset``. Otherwise hold the tokens. ``finish`` emits
whatever is held, U+FFFD included, because the full decode has it there too.
Cost: O(window) per call, and the window is a few tokens for well-formed text
(a held character completes within 4 tokens). A run of malformed byte tokens (or
of U+FFFD the model writes) keeps the text ending in U+FFFD; once more than
``MAX_HELD_TOKENS`` are held, the text up to the last token boundary followed by
at least 3 characters (so 3 bytes: a UTF-8 character has at most 4, and no later
byte can change what precedes them) is final and emitted, so the window, and the
cost of a call, stay bounded however long the run (without it, 4,000 such tokens
took 6 s of the gateway's event loop, measured). That holds for byte-level BPE,
where each token decodes on its own bytes; a SentencePiece byte-fallback decoder
(Llama 2, Mistral) decodes a run of ``<0xNN>`` tokens as one unit, so no boundary
inside such a run is taken and such a run is held whole, as before. (Such a
decoder can still change text already emitted: a valid byte run, emitted, that a
later invalid byte joins becomes U+FFFD as a whole in the full decode; vLLM's
algorithm shares this. Models emit valid UTF-8 in practice.)

Invariant (tested)::

    "".join(pieces) == tokenizer.decode(output_ids, skip_special_tokens=...)

when ``prompt_token_ids`` is None. With ``prompt_token_ids`` the last few prompt
tokens are decoding context (as vLLM does): the pieces are then the text the
output adds after the prompt's text. For byte-level BPE (Llama 3, Qwen2,
SmolLM2) that is the same string; for SentencePiece decoders that strip a
leading space it keeps the space. Use one mode for streamed and non-streamed
responses (non-streamed: ``add(all_ids) + finish()``) so they agree byte for byte.

Why not ``tokenizers.decoders.DecodeStream``: it holds an incomplete character
the same way but has no flush, so text that ends in malformed bytes would lose
the final U+FFFD that ``decode`` shows, breaking the invariant.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback token's piece
# Prompt tokens used as decoding context: vLLM v1 tries suffixes of 4..23 tokens
# and takes the first that decodes without U+FFFD.
_MIN_CONTEXT_TOKENS = 4
_MAX_CONTEXT_TOKENS = 24
MAX_HELD_TOKENS = 8  # tokens held past the read offset before the settled part of the text is emitted
_SETTLED_TAIL_CHARS = 3  # characters after a boundary that settle the text before it (UTF-8: at most 4 bytes)


class IncrementalDetokenizer:
    """Turns a request's output token ids into final text pieces.

    Args:
        tokenizer: a ``transformers`` tokenizer (``decode``, and ``convert_ids_to_tokens``
            when it has one).
        prompt_token_ids: the prompt's ids, used as decoding context (see the
            module docstring), or None to decode the output alone.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = self._context(prompt_token_ids) if prompt_token_ids else []
        self._window: list[int] = context  # ids[prefix_offset:]; earlier ids are dropped
        self._read = len(context)  # read_offset, relative to the window
        self._prefix_text = self._decode(context)  # text of window[:read]
        self._finished = False
        self.num_output_tokens = 0
        self._byte_tokens: dict[int, bool] = {}  # token id -> a byte-fallback token (``_is_byte_token``)

    def add(self, token_ids: Sequence[int]) -> str:
        """Adds output token ids; returns the text that became final ("" if none).

        Raises:
            RuntimeError: called after ``finish``.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after finish()")
        self._window.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        if len(self._window) == self._read:
            return ""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            if len(self._window) - self._read > MAX_HELD_TOKENS:
                return self._emit_settled(text)
            return ""  # nothing new, or an incomplete character at the end: hold
        return self._emit(text)

    def finish(self) -> str:
        """Ends the stream; returns the held text, partial characters as U+FFFD."""
        if self._finished:
            return ""
        self._finished = True
        if len(self._window) == self._read:
            return ""
        return self._emit(self._decode(self._window))

    def _emit(self, text: str) -> str:
        """Emits ``text`` past the prefix and slides the window to the old read offset."""
        piece = text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return piece

    def _emit_settled(self, text: str) -> str:
        """Emits ``text`` (the window's) up to the last token boundary ``k`` whose text is
        a prefix of it with at least ``_SETTLED_TAIL_CHARS`` characters after, and slides
        the window to the old read offset with ``k`` as the new one ("" if no boundary
        qualifies: the tokens stay held)."""
        window = self._window[self._read :]  # the window once slid: the same for every k
        window_text = None  # its text, decoded once, when a boundary gets that far
        for k in range(len(self._window) - 1, self._read, -1):
            if self._is_byte_token(self._window[k - 1]) and self._is_byte_token(self._window[k]):
                continue  # inside a run of byte-fallback tokens, decoded as one: later bytes may change it
            head = self._decode(self._window[:k])
            if (len(text) - len(head) < _SETTLED_TAIL_CHARS or len(head) <= len(self._prefix_text)
                    or not text.startswith(head)):
                continue
            prefix_text = self._decode(window[: k - self._read])
            window_text = self._decode(window) if window_text is None else window_text
            if window_text.startswith(prefix_text):
                piece = head[len(self._prefix_text) :]
                self._window, self._read, self._prefix_text = window, k - self._read, prefix_text
                return piece
        return ""

    def _is_byte_token(self, token_id: int) -> bool:
        """Whether ``token_id`` is a SentencePiece byte-fallback token (``<0xNN>``, as in
        Llama 2 and Mistral): their decoder turns a run of them into text as one unit, so
        one invalid byte makes every byte of the run U+FFFD. Byte-level BPE (SmolLM2,
        Llama 3, Qwen2) has none."""
        known = self._byte_tokens.get(token_id)
        if known is None:
            to_tokens = getattr(self._tokenizer, "convert_ids_to_tokens", None)
            piece = to_tokens(token_id) if to_tokens is not None else None
            known = self._byte_tokens[token_id] = isinstance(piece, str) and _BYTE_TOKEN.fullmatch(piece) is not None
        return known

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest prompt suffix of >= 4 tokens that decodes without U+FFFD ([] if none)."""
        n = len(prompt_token_ids)
        for k in range(min(_MIN_CONTEXT_TOKENS, n), min(_MAX_CONTEXT_TOKENS, n) + 1):
            suffix = list(prompt_token_ids[n - k :])
            if REPLACEMENT_CHAR not in self._decode(suffix):
                return suffix
        return []
