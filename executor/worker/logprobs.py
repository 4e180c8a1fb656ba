"""Logprobs of sampled and prompt tokens.

Definition (vLLM v1's default, "raw logprobs"): the natural-log probabilities of
the model's own distribution, ``log_softmax`` of the float32 logits *before*
``min_tokens`` masks, ``logit_bias``, penalties, temperature and top-k/top-p/min-p. A position
gives the logprob of its token (sampled, or the prompt's own) and the ``k`` most
likely tokens with theirs, highest first.

Prompt logprobs: position ``p`` (1 <= p < num_prompt) is the logprob of prompt
token ``p`` given tokens ``0 .. p-1``, read from the hidden state at ``p - 1``.
They are computed chunk by chunk during prefill, ``PROMPT_LOGPROBS_ROWS`` rows of
``(rows, vocab_size)`` logits at a time, so memory stays bounded whatever the
prompt's length, and handed out with the request's first sampled token. They
need every prompt position to be computed here: a request with prompt logprobs
must not take KV from the prefix cache (the KV cache manager skips it for them).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from executor.engine.outputs import TokenLogprob
from executor.engine.scheduler_output import ScheduledRequest

log = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 256


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """Each row's token logprob, its rank and top-``k`` from raw logits.

    The rank is vLLM's (``batched_count_greater_than``): the number of tokens whose
    logprob is at least the row's token's, so 1 for the most likely (ties count).

    Args:
        logits: ``(rows, vocab_size)`` float32 raw logits.
        token_ids: ``(rows,)`` int64, the token at each position.
        ks: per row, how many top entries to return (>= 0).
    """
    if not ks:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_column = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs >= chosen_column).sum(dim=-1).tolist()
    chosen = chosen_column.view(-1).tolist()
    ids = token_ids.tolist()
    max_k = max(ks)
    if max_k == 0:
        return [TokenLogprob(t, c, rank=r) for t, c, r in zip(ids, chosen, ranks)]
    top = logprobs.topk(max_k, dim=-1, sorted=True)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [TokenLogprob(t, c, tuple(ti[:k]), tuple(tv[:k]), r)
            for t, c, ti, tv, k, r in zip(ids, chosen, top_ids, top_values, ks, ranks)]


class PromptLogprobs:
    """Accumulates each request's prompt logprobs over its prefill chunks (state of
    the model runner; dropped with ``release``)."""

    def __init__(self) -> None:
        self._partial: dict[str, list[TokenLogprob]] = {}
        self._delivered: set[str] = set()

    def collect(self, scheduled: list[ScheduledRequest], query_start_loc: list[int], hidden: torch.Tensor,
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, list[TokenLogprob]]:
        """Computes this step's prompt positions for every request that asked.

        Args:
            scheduled: the step's requests, in batch order.
            query_start_loc: ``(num_reqs + 1,)`` row offsets of each request in ``hidden``.
            hidden: ``(num_tokens, hidden_size)`` final hidden states of the step.
            compute_logits: the model's head, ``(rows, hidden_size)`` → ``(rows, vocab)``.

        Returns:
            request id → its complete prompt logprobs, for requests that sample this step.
        """
        rows, targets, ks, owners = [], [], [], []
        for i, s in enumerate(scheduled):
            k = s.sampling_params.prompt_logprobs
            if k is None or s.request_id in self._delivered:
                continue
            start = s.num_computed_tokens
            partial = self._partial.setdefault(s.request_id, [])
            if start < len(partial):
                del partial[start:]  # recomputing (preempted): positions come again
            elif start > len(partial):
                log.warning("request %s: prompt positions %d..%d were not computed (prefix cache hit?)",
                            s.request_id, len(partial) + 1, start)
            end = min(start + s.num_scheduled_tokens, s.num_prompt_tokens - 1)
            for p in range(start, end):  # hidden row of position p predicts prompt token p + 1
                rows.append(query_start_loc[i] + p - start)
                targets.append(s.all_token_ids[p + 1])
                ks.append(k)
                owners.append(s.request_id)
        entries: list[TokenLogprob] = []
        for lo in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            index = torch.tensor(rows[lo:lo + PROMPT_LOGPROBS_ROWS], dtype=torch.int64, device=hidden.device)
            target = torch.tensor(targets[lo:lo + PROMPT_LOGPROBS_ROWS], dtype=torch.int64, device=hidden.device)
            entries += token_logprobs(compute_logits(hidden[index]), target, ks[lo:lo + PROMPT_LOGPROBS_ROWS])
        for owner, entry in zip(owners, entries):
            self._partial[owner].append(entry)
        done = {}
        for s in scheduled:
            if s.sample and s.request_id in self._partial:
                done[s.request_id] = self._partial.pop(s.request_id)
                self._delivered.add(s.request_id)
        return done

    def release(self, request_ids: set[str]) -> None:
        """Drops the state of finished requests."""
        for request_id in request_ids:
            self._partial.pop(request_id, None)
            self._delivered.discard(request_id)
