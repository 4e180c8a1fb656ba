"""A logprob's rank (``executor.worker.logprobs.token_logprobs``): vLLM's count of the
tokens whose logprob is at least the position's token's, so 1 for the most likely and
ties counted, for sampled and prompt tokens alike."""

from __future__ import annotations

import torch

from executor.worker.logprobs import token_logprobs


def test_the_rank_counts_the_tokens_at_least_as_likely():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 1000, generator=generator)
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1.0  # a tie at the top: both rank 2
    token_ids = torch.tensor([int(logits[0].argmax()), 17, 500, 11, int(logits[4].argmin())])
    entries = token_logprobs(logits, token_ids, [0, 2, 0, 3, 1])
    logprobs = torch.log_softmax(logits, dim=-1)
    want = [sum(1 for v in row.tolist() if v >= row[t].item()) for row, t in zip(logprobs, token_ids.tolist())]
    assert [e.rank for e in entries] == want
    assert (want[0], want[3], want[4]) == (1, 2, 1000)
    assert [len(e.top_token_ids) for e in entries] == [0, 2, 0, 3, 1]
