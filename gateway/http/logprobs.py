"""Token log-probabilities in OpenAI's two shapes.

* chat (``choices[i].logprobs``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``, one entry per
  generated token, its alternatives highest first (``top_logprobs`` of them).
* completions (``choices[i].logprobs``): ``{"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}, ...], "text_offset"}``, parallel lists; each
  position's alternatives also hold the sampled token when it is not among them
  (OpenAI: "up to logprobs+1 elements", as vLLM gives them; ``logprobs: 0``: the
  sampled token alone).

A token's text is the tokenizer's decoding of that one id (as vLLM gives it; a
byte-level token that is part of a multi-byte character decodes to U+FFFD), and
``bytes`` are that text's UTF-8 bytes. Values are the core's (``gateway.events``):
natural-log probabilities of the model's raw distribution.
"""

from __future__ import annotations

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


def _alternatives(entry: TokenLogprob, texts: TokenTexts) -> dict[str, float]:
    """A completions position's ``{token: logprob}``: its top k, then the sampled token
    when it is not among them."""
    top = {texts(t.token_id): t.logprob for t in entry.top}
    if all(t.token_id != entry.token_id for t in entry.top):
        top.setdefault(texts(entry.token_id), entry.logprob)
    return top
