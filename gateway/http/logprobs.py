"""Token log-probabilities in OpenAI's two shapes.

* chat (``choices[i].logprobs``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``, one entry per
  generated token, its alternatives highest first (``top_logprobs`` of them).
* completions (``choices[i].logprobs``): ``{"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}, ...], "text_offset"}``, parallel lists; each
  position's alternatives also hold the sampled token when it is not among them
  (OpenAI: "up to logprobs+1 elements", as vLLM gives them; ``logprobs: 0``: the
  sampled token alone).
* vLLM's ``prompt_logprobs`` (completions: ``choices[i].prompt_logprobs``; chat: the
  response's own ``prompt_logprobs``): one entry per prompt token, null for the first
  (it has no context), then ``{token id: {"logprob", "rank", "decoded_token"}}``:
  the prompt's own token first, then the top k with ranks 1 … k. A prompt token among
  its top k is one key, with its rank there (as vLLM's dict, where the top k's entry
  replaces it); one outside them has its rank in the whole vocabulary (the
  executor's, as vLLM counts it; null from an executor that does not send it). A
  logprob of -inf is -9999.0, as vLLM clamps it (JSON has no infinity), here and in
  the two shapes above (a structured output's mask gives -inf to the tokens its grammar
  forbids, which a top k can hold when fewer tokens are allowed).

A token's text is the tokenizer's decoding of that one id, and ``bytes`` are that
text's UTF-8 bytes. A byte-level token that holds only part of a multi-byte
character decodes alone to U+FFFD; its text is then vLLM's correction
(``LogprobsProcessor._correct_decoded_token``): decoded after up to the last
``CONTEXT_TOKENS`` sampled tokens of its sequence, a token that completes a
character gets the text the character's pieces did not show (the character, and
what the token adds after it), and one that leaves it unfinished gets "". So the
texts of a choice's tokens join to its text, and ``text_offset`` stays within it.
The same holds for a position's alternatives (after the same sampled tokens) and
for a prompt's tokens (after the prompt's from position 1, the first having no
entry, as in vLLM).
Values are the core's (``gateway.events``): natural-log probabilities of the
model's raw distribution.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Iterable, Sequence

from gateway.detokenizer import REPLACEMENT_CHAR
from gateway.events import TokenLogprob
from meshserve.sampling import floored_logprob

CONTEXT_TOKENS = 4
"""Sampled tokens before a token that ``TokenTexts.in_context`` decodes it after (vLLM's:
a UTF-8 character spans at most 4 byte tokens)."""


class TokenTexts:
    """The text of single token ids, decoded once each (bounded by the vocabulary)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def in_context(self, token_id: int, context: Sequence[int]) -> str:
        """The text of ``token_id`` after the sampled tokens ``context`` (oldest first):
        its own decoding, unless that ends in U+FFFD (part of a character); then the text
        it completes, or "" (see the module docstring)."""
        text = self(token_id)
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        context = list(context)[-CONTEXT_TOKENS:]
        for k in range(1, len(context) + 1):
            before = context[-k:]
            full = self._tokenizer.decode(before + [token_id])
            if full.endswith(REPLACEMENT_CHAR):
                continue
            clean = len(before)  # the context's own text ends before its unfinished pieces
            while clean > 0 and self(before[clean - 1]).endswith(REPLACEMENT_CHAR):
                clean -= 1
            prefix = self._tokenizer.decode(before[:clean]) if clean else ""
            return full[len(os.path.commonprefix([prefix, full])):]
        return ""


def _sampled(entries: Iterable[TokenLogprob], context: deque[int]) -> Iterable[tuple[TokenLogprob, deque[int]]]:
    """Each entry with the sampled tokens before it (``context``, which it then joins)."""
    for e in entries:
        yield e, context
        context.append(e.token_id)


def sampled_context() -> deque[int]:
    """A choice's last sampled ids, as ``chat_logprobs`` and ``completion_logprobs`` keep
    them across a stream's chunks."""
    return deque(maxlen=CONTEXT_TOKENS)


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, context: deque[int] | None = None) -> dict:
    """The chat shape of ``entries`` (one per generated token); ``context``: the choice's
    sampled ids before them (``sampled_context``; updated)."""
    def one(token_id: int, logprob: float, before: deque[int]) -> dict:
        text = texts.in_context(token_id, before)
        return {"token": text, "logprob": floored_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob, before),
                         "top_logprobs": [one(t.token_id, t.logprob, before) for t in e.top]}
                        for e, before in _sampled(entries, sampled_context() if context is None else context)]}


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0,
                        context: deque[int] | None = None) -> dict:
    """The completions shape of ``entries``; ``offset``: the text offset (characters)
    of the first entry's token in the choice's text; ``context``: as ``chat_logprobs``'s."""
    tokens, offsets, alternatives = [], [], []
    for e, before in _sampled(entries, sampled_context() if context is None else context):
        tokens.append(texts.in_context(e.token_id, before))
        alternatives.append(_alternatives(e, texts, before))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [floored_logprob(e.logprob) for e in entries],
            "top_logprobs": alternatives, "text_offset": offsets}


def echoed_prompt_logprobs(prompt_ids: Sequence[int], prompt_entries: Sequence[TokenLogprob], texts: TokenTexts,
                           k: int) -> dict:
    """The completions shape of an echoed prompt (vLLM's ``echo`` with ``logprobs: k``):
    its first token has no logprob (null, and null alternatives), each later one its
    prompt logprob and its top ``k`` (of ``prompt_entries``: one per position after the
    first, which may hold more; -inf as -9999.0). Texts as vLLM's: each after the
    prompt's tokens from position 1 (as ``prompt_logprobs``). Built once per prompt;
    ``echoed_logprobs`` adds a choice's tokens."""
    if not prompt_ids:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    tokens, logprobs, tops, offsets = [texts(prompt_ids[0])], [None], [None], [0]
    for e, before in _sampled(prompt_entries, sampled_context()):
        e = TokenLogprob(e.token_id, e.logprob, e.top[:k], e.rank)
        offsets.append(offsets[-1] + len(tokens[-1]))
        tokens.append(texts.in_context(e.token_id, before))
        logprobs.append(floored_logprob(e.logprob))
        tops.append(_alternatives(e, texts, before))
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(prompt: dict, entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """``prompt`` (``echoed_prompt_logprobs``) and then a choice's ``entries``, the offsets
    running on over both; the generated tokens' texts after the generated ones only (vLLM's)."""
    end = prompt["text_offset"][-1] + len(prompt["tokens"][-1]) if prompt["tokens"] else 0
    generated = completion_logprobs(entries, texts, end)
    return {key: prompt[key] + generated[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of one prompt from the core's ``entries`` (one per
    prompt position after the first)."""
    def one(logprob: float, rank: int | None, decoded: str) -> dict:
        return {"logprob": floored_logprob(logprob), "rank": rank, "decoded_token": decoded}

    out: list[dict | None] = [None]
    for e, before in _sampled(entries, sampled_context()):
        position = {str(e.token_id): one(e.logprob, e.rank or None, texts.in_context(e.token_id, before))}
        for rank, t in enumerate(e.top, 1):  # the core's top k: highest first
            position[str(t.token_id)] = one(t.logprob, rank, texts.in_context(t.token_id, before))
        out.append(position)
    return out


def _alternatives(entry: TokenLogprob, texts: TokenTexts, before: Sequence[int]) -> dict[str, float]:
    """A completions position's ``{token: logprob}``: its top k, then the sampled token
    when it is not among them (each token's text after the sampled ids ``before``)."""
    top = {texts.in_context(t.token_id, before): floored_logprob(t.logprob) for t in entry.top}
    if all(t.token_id != entry.token_id for t in entry.top):
        top.setdefault(texts.in_context(entry.token_id, before), floored_logprob(entry.logprob))
    return top
