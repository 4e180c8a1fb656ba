"""OpenAI's response and chunk objects from the core's events, for chat and completions.

``ChatFormat`` builds ``chat.completion`` / ``chat.completion.chunk`` objects and
``CompletionFormat`` ``text_completion`` ones (OpenAI's API reference, as vLLM
serves them; vLLM's ``stop_reason`` is added to each finished choice: the stop
string that ended it, else the id (an int) of the one of ``stop_token_ids`` that
did, else null (the length, the model's EOS); with vLLM's ``return_token_ids`` each
choice also carries ``token_ids``: in a chunk its delta's, in a response all of them, and
``prompt_token_ids`` as vLLM places them: in completions each choice its prompt's (a
stream: on the choice's first chunk), in chat the response itself (a stream: the
role chunk); with vLLM's
``prompt_logprobs`` a whole response carries them, ``gateway.http.logprobs``'s shape:
in completions each choice its prompt's, in chat the response itself). vLLM's
``include_stop_str_in_output`` is the core's (``GenerationRequest``): the stop string
is a delta of its own, which a stream joins to the last tokens' chunk and its finish
reason (``merge_choices``). Choice
``index`` is ``prompt * n + choice``, so with several prompts choice ``i`` belongs
to prompt ``i // n``.

Usage: ``prompt_tokens`` counts each prompt once (not once per choice),
``completion_tokens`` every choice's tokens, ``prompt_tokens_details.cached_tokens``
the prompt tokens whose KV was reused.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

from gateway.collector import CompletedChoice
from gateway.events import ChoiceResult, Delta
from gateway.http.logprobs import (TokenTexts, chat_logprobs, completion_logprobs, echoed_logprobs,
                                   echoed_prompt_logprobs, prompt_logprobs, sampled_context)


def usage_of(results: Sequence[ChoiceResult]) -> dict:
    """OpenAI's ``usage`` of the results of every choice (choice 0 of each prompt
    carries that prompt's counts)."""
    prompt = sum(r.usage.prompt_tokens for r in results if r.index == 0)
    cached = sum(r.usage.cached_tokens for r in results if r.index == 0)
    completion = sum(r.usage.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(result: ChoiceResult | None) -> str | None:
    return result.finish_reason.value if result is not None and result.finish_reason is not None else None


def _stop_reason(result: ChoiceResult | None) -> str | int | None:
    """vLLM's ``stop_reason``: the stop string, else the stop token's id, else None."""
    if result is None:
        return None
    return result.stop_reason or result.stop_token_id


def merge_choices(held: dict, later: dict) -> dict:
    """One chunk's choice from two of the same choice, ``held`` first: texts (or chat
    contents), token ids and logprobs joined, the rest ``later``'s where it has them (the
    finish reason). A stream sends a choice's last tokens with its finish reason, in one
    chunk, as vLLM does (``Delta.last``)."""
    out = dict(held)
    for key, value in later.items():
        if key == "text":
            out[key] = held.get(key, "") + value
        elif key == "delta":
            content = held[key].get("content", "") + value.get("content", "")
            out[key] = {**held[key], "content": content} if content or "content" in held[key] else dict(held[key])
        elif key == "token_ids":
            out[key] = held.get(key, []) + value
        elif key == "logprobs":
            out[key] = _joined_logprobs(held.get(key), value)
        elif key not in out or value is not None:
            out[key] = value
    return out


def _joined_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two chunks' ``logprobs`` as one (each list joined); either may be None."""
    if first is None or second is None:
        return first if second is None else second
    return {key: first[key] + second[key] for key in first}


class _Format:
    """What both shapes share: the response id, model name, creation time, ``n``."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, n: int, tokenizer, logprobs: bool,
                 return_token_ids: bool = False, prompt_logprobs: bool = False):
        self.id, self.model, self.n = response_id, model, n
        self.created = int(time.time())
        self.logprobs = logprobs
        self.return_token_ids = return_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.texts = TokenTexts(tokenizer)
        self.contexts: dict[int, deque[int]] = {}  # a streamed choice's last sampled ids (its logprobs' texts)
        self.prompt_ids: dict[int, list[int]] = {}  # prompt index -> its ids, for a stream (``set_prompt_ids``)

    def set_prompt_ids(self, prompt: int, ids: list[int]) -> None:
        """Prompt ``prompt``'s ids, known once it is prepared: a stream's chunks carry them
        (``return_token_ids``) before the results, which carry them too, come."""
        self.prompt_ids[prompt] = ids

    def prompt_logprobs_of(self, choices: Sequence[CompletedChoice]) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs`` of one prompt, from its choices (choice 0's result
        carries the core's); None when the request did not ask, or choice 0 has no result."""
        first = next((c.result for c in choices if c.index == 0), None)
        if not self.prompt_logprobs or first is None:
            return None
        return prompt_logprobs(first.prompt_logprobs, self.texts)

    def _carries(self, text: str, token_ids) -> bool:
        """True when a delta of ``text`` and ``token_ids`` has something to send: text, or
        tokens whose logprobs or ids were asked for (a delta whose text is held back, e.g.
        half a UTF-8 character, still carries its tokens)."""
        return bool(text) or bool(token_ids and (self.logprobs or self.return_token_ids))

    def _with_ids(self, choice: dict, token_ids) -> dict:
        """``choice`` with vLLM's ``token_ids`` when the request asked for them."""
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def index(self, prompt: int, choice: int) -> int:
        """The response's choice index of choice ``choice`` of prompt ``prompt``."""
        return prompt * self.n + choice

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        """One stream chunk (``usage`` key present when the caller asked for usage)."""
        out = {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model,
               "choices": choices}
        if with_usage:
            out["usage"] = usage
        return out

    def response(self, choices: list[dict], results: Sequence[ChoiceResult],
                 prompts_logprobs: Sequence[list[dict | None] | None] = ()) -> dict:
        """The whole (non-streamed) response; ``prompts_logprobs``: each prompt's
        ``prompt_logprobs_of``, which each shape places (when asked) in its override."""
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_of(results)}


class ChatFormat(_Format):
    """``chat.completion`` objects."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def role_chunk(self, index: int, with_usage: bool) -> dict:
        """The first chunk of choice ``index``: it announces the assistant role (and carries
        vLLM's ``prompt_token_ids`` when asked)."""
        out = self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}], with_usage=with_usage)
        if self.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids.get(index // self.n)
        return out

    def delta_choice(self, index: int, delta: Delta) -> dict | None:
        """A chunk's choice for ``delta`` (None when it carries nothing to send)."""
        if not self._carries(delta.text, delta.token_ids):
            return None
        logprobs = None
        if self.logprobs:
            logprobs = chat_logprobs(delta.logprobs, self.texts, self.contexts.setdefault(index, sampled_context()))
        return self._with_ids({"index": index, "delta": {"content": delta.text}, "logprobs": logprobs,
                               "finish_reason": None}, delta.token_ids)

    def finish_choice(self, index: int, result: ChoiceResult) -> dict:
        """The last chunk's choice of ``index``: its finish reason."""
        return {"index": index, "delta": {}, "logprobs": None,
                "finish_reason": _finish_reason(result), "stop_reason": _stop_reason(result)}

    def response(self, choices: list[dict], results: Sequence[ChoiceResult],
                 prompts_logprobs: Sequence[list[dict | None] | None] = ()) -> dict:
        """The whole response; vLLM's ``prompt_logprobs`` (of its one prompt) after the usage."""
        out = super().response(choices, results)
        if self.prompt_logprobs:
            out["prompt_logprobs"] = prompts_logprobs[0] if prompts_logprobs else None
        if self.return_token_ids:
            out["prompt_token_ids"] = list(results[0].prompt_token_ids) if results else None
        return out

    def full_choice(self, index: int, c: CompletedChoice, prompt_result: ChoiceResult | None = None) -> dict:
        """A choice of the non-streamed response (``prompt_result``: unused, as a chat echoes nothing)."""
        return self._with_ids({"index": index, "message": {"role": "assistant", "content": c.text},
                               "logprobs": chat_logprobs(c.logprobs, self.texts) if self.logprobs else None,
                               "finish_reason": _finish_reason(c.result),
                               "stop_reason": _stop_reason(c.result)}, c.token_ids)


class CompletionFormat(_Format):
    """``text_completion`` objects.

    ``echo`` (vLLM's): each prompt's text as the request gave it (None for a token-id
    prompt: its ids' decode, special tokens kept), which starts the text of each of its
    choices (a stream: the choice's first chunk), unless ``return_token_ids`` (then the
    ids say it: vLLM leaves the text out); with ``logprobs: k`` (``echo_top``) the
    prompt's tokens lead ``logprobs`` with their top k (``echoed_logprobs``; a whole
    response only). ``echo_only`` (``max_tokens: 0``): the prompt alone, without the one
    token the request ran.
    """

    object_name = chunk_object_name = "text_completion"

    def __init__(self, response_id: str, model: str, n: int, tokenizer, logprobs: bool,
                 return_token_ids: bool = False, prompt_logprobs: bool = False,
                 echo: Sequence[str | None] | None = None, echo_only: bool = False, echo_top: int = 0):
        super().__init__(response_id, model, n, tokenizer, logprobs, return_token_ids, prompt_logprobs)
        self._offsets: dict[int, int] = {}  # index -> text offset of its next token (logprobs)
        self._started: set[int] = set()  # the choices whose first chunk was built
        self.tokenizer = tokenizer
        self.echo = None if echo is None else list(echo)
        self.echo_only = echo_only
        self.echo_top = echo_top
        self._echoed_logprobs: dict[int, dict] = {}  # prompt index -> its echoed logprobs, built once for its n

    def _echoed(self, index: int) -> str:
        """The text choice ``index`` starts with: its prompt's with ``echo`` (and without
        ``return_token_ids``), else ""."""
        if self.echo is None or self.return_token_ids:
            return ""
        p = index // self.n
        if self.echo[p] is None:  # a token-id prompt: decoded once, when first needed
            self.echo[p] = self.tokenizer.decode(self.prompt_ids.get(p, []))
        return self.echo[p]

    def role_chunk(self, index: int, with_usage: bool) -> None:
        return None  # completions announce no role

    def _first_of(self, index: int, choice: dict) -> dict:
        """``choice`` with its prompt's ids (vLLM's ``prompt_token_ids``) when it is the
        first chunk of choice ``index`` and the request asked for token ids."""
        if self.return_token_ids and index not in self._started:
            choice["prompt_token_ids"] = self.prompt_ids.get(index // self.n)
        self._started.add(index)
        return choice

    def delta_choice(self, index: int, delta: Delta) -> dict | None:
        """A chunk's choice for ``delta`` (None when it carries nothing to send)."""
        first = self.echo is not None and index not in self._started  # it carries the echoed prompt
        text = "" if self.echo_only else delta.text
        if not first and not self._carries(text, delta.token_ids):
            return None
        logprobs = None
        if self.logprobs:  # never with echo: echo with logprobs is not streamed
            offset = self._offsets.get(index, 0)
            logprobs = completion_logprobs(delta.logprobs, self.texts, offset,
                                           self.contexts.setdefault(index, sampled_context()))
            self._offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
        text = (self._echoed(index) if first else "") + text
        return self._first_of(index, self._with_ids({"index": index, "text": text, "logprobs": logprobs,
                                                     "finish_reason": None}, delta.token_ids))

    def finish_choice(self, index: int, result: ChoiceResult) -> dict:
        text = self._echoed(index) if index not in self._started else ""  # a choice that sent nothing before
        return self._first_of(index, {"index": index, "text": text, "logprobs": None,
                                      "finish_reason": _finish_reason(result), "stop_reason": _stop_reason(result)})

    def full_choice(self, index: int, c: CompletedChoice, prompt_result: ChoiceResult | None = None) -> dict:
        """A choice of the whole response; ``prompt_result``: its prompt's choice 0's
        result (the prompt's logprobs, for ``echo`` with logprobs)."""
        entries = () if self.echo_only else c.logprobs
        logprobs = None
        if self.logprobs and self.echo is not None and prompt_result is not None:
            p = index // self.n
            if p not in self._echoed_logprobs:
                self._echoed_logprobs[p] = echoed_prompt_logprobs(prompt_result.prompt_token_ids,
                                                                  prompt_result.prompt_logprobs, self.texts,
                                                                  self.echo_top)
            logprobs = echoed_logprobs(self._echoed_logprobs[p], entries, self.texts)
        elif self.logprobs:
            logprobs = completion_logprobs(entries, self.texts)
        choice = self._with_ids({"index": index, "text": self._echoed(index) + ("" if self.echo_only else c.text),
                                 "logprobs": logprobs, "finish_reason": _finish_reason(c.result),
                                 "stop_reason": _stop_reason(c.result)}, c.token_ids)
        if self.return_token_ids:
            choice["prompt_token_ids"] = list(c.result.prompt_token_ids) if c.result is not None else None
        return choice

    def response(self, choices: list[dict], results: Sequence[ChoiceResult],
                 prompts_logprobs: Sequence[list[dict | None] | None] = ()) -> dict:
        """The whole response; each choice carries vLLM's ``prompt_logprobs`` of its own
        prompt (choice ``i``: prompt ``i // n``), after its other fields."""
        if self.prompt_logprobs:
            for choice in choices:
                p = choice["index"] // self.n
                choice["prompt_logprobs"] = prompts_logprobs[p] if p < len(prompts_logprobs) else None
        return super().response(choices, results)
