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
  replaces it); one outside them has ``rank`` null, where vLLM gives its rank in the
  whole vocabulary, which the core does not compute. A logprob of -inf is -9999.0,
  as vLLM clamps it (JSON has no infinity).

A token's text is the tokenizer's decoding of that one id (as vLLM gives it; a
byte-level token that is part of a multi-byte character decodes to U+FFFD), and
``bytes`` are that text's UTF-8 bytes. Values are the core's (``gateway.events``):
natural-log probabilities of the model's raw distribution.
"""

from __future__ import annotations

import math
from typing import Sequence

from gateway.events import TokenLogprob


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


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """The chat shape of ``entries`` (one per generated token)."""
    def one(token_id: int, logprob: float) -> dict:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                        for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict:
    """The completions shape of ``entries``; ``offset``: the text offset (characters)
    of the first entry's token in the choice's text."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(texts(e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_alternatives(e, texts) for e in entries], "text_offset": offsets}


PROMPT_LOGPROB_FLOOR = -9999.0  # vLLM's value for a prompt token's -inf


def prompt_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of one prompt from the core's ``entries`` (one per
    prompt position after the first)."""
    def one(logprob: float, rank: int | None, token_id: int) -> dict:
        value = PROMPT_LOGPROB_FLOOR if logprob == -math.inf else logprob
        return {"logprob": value, "rank": rank, "decoded_token": texts(token_id)}

    out: list[dict | None] = [None]
    for e in entries:
        position = {str(e.token_id): one(e.logprob, None, e.token_id)}
        for rank, t in enumerate(e.top, 1):  # the core's top k: highest first
            position[str(t.token_id)] = one(t.logprob, rank, t.token_id)
        out.append(position)
    return out


def _alternatives(entry: TokenLogprob, texts: TokenTexts) -> dict[str, float]:
    """A completions position's ``{token: logprob}``: its top k, then the sampled token
    when it is not among them."""
    top = {texts(t.token_id): t.logprob for t in entry.top}
    if all(t.token_id != entry.token_id for t in entry.top):
        top.setdefault(texts(entry.token_id), entry.logprob)
    return top
