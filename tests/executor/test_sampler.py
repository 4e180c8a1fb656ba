"""Sampler: greedy exactness, top-k/top-p limits, per-request seeded generators."""

from __future__ import annotations

import torch

from executor.engine.sampler import Sampler, SamplingBatch
from meshserve.sampling import SamplingParams

VOCAB = 1000


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def sample(sampler: Sampler, x: torch.Tensor, params: list[SamplingParams], generators=None) -> list[int]:
    generators = generators or [None] * len(params)
    return sampler(x, SamplingBatch.build(params, generators, VOCAB)).tolist()


def test_greedy_is_exact_argmax_first_index_on_ties():
    x = logits(4)
    x[2, 10] = x[2, 20] = x[2].max() + 1.0  # a tie: the first index wins
    tokens = sample(Sampler(), x, [SamplingParams(temperature=0.0)] * 4)
    assert tokens == x.argmax(dim=-1).tolist()
    assert tokens[2] == 10


def test_top_k_1_and_tiny_top_p_equal_greedy_at_any_temperature():
    x = logits(8, seed=1)
    greedy = x.argmax(dim=-1).tolist()
    sampler = Sampler(seed=3)
    for _ in range(5):
        assert sample(sampler, x, [SamplingParams(temperature=1.5, top_k=1)] * 8) == greedy
        assert sample(sampler, x, [SamplingParams(temperature=1.5, top_p=1e-6)] * 8) == greedy
        assert sample(sampler, x, [SamplingParams(temperature=5e-4)] * 8) == greedy  # below GREEDY_TEMPERATURE


def test_top_k_and_top_p_only_pick_allowed_tokens():
    x = logits(1, seed=2).repeat(64, 1)
    top5 = set(x[0].topk(5).indices.tolist())
    tokens = sample(Sampler(seed=4), x, [SamplingParams(temperature=2.0, top_k=5)] * 64)
    assert set(tokens) <= top5 and len(set(tokens)) > 1
    probs = torch.softmax(x[0] / 2.0, dim=-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    tokens = sample(Sampler(seed=5), x, [SamplingParams(temperature=2.0, top_p=0.5)] * 64)
    assert set(tokens) <= nucleus


def test_mixed_batch_keeps_greedy_rows_exact_and_never_nan():
    x = logits(4, seed=6)
    x[1, :] = float("nan")
    x[1, 5] = 3.0
    x[3, 7] = float("inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=3, top_p=0.9), SamplingParams(temperature=1.0)]
    tokens = sample(Sampler(), x, params)
    assert tokens[0] == x[0].argmax().item()
    assert tokens[1] == 5 and tokens[3] == 7
    assert all(0 <= t < VOCAB for t in tokens)


def test_seeded_request_gives_same_tokens_alone_and_in_any_batch():
    x = logits(6, seed=7)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(batch_rows: list[int], seeded_row: int, steps: int = 6) -> list[int]:
        sampler = Sampler(seed=99)
        generator = torch.Generator().manual_seed(seeded.seed)
        out = []
        for _ in range(steps):
            params = [SamplingParams(temperature=1.0) for _ in batch_rows]
            params[seeded_row] = seeded
            gens = [None] * len(batch_rows)
            gens[seeded_row] = generator
            out.append(sample(sampler, x[batch_rows], params, gens)[seeded_row])
        return out

    alone = run([0], 0)
    assert run([3, 0, 5], 1) == alone
    assert run([0, 1, 2, 4, 5], 0) == alone
    assert len(set(alone)) > 1  # it does sample
    unseeded = [sample(Sampler(seed=s), x[:1], [SamplingParams(temperature=1.0)])[0] for s in range(8)]
    assert len(set(unseeded)) > 1
