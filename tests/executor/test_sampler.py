"""Sampler: greedy exactness, top-k/top-p limits, per-request seeded generators."""

from __future__ import annotations

import pytest
import torch

from executor.worker.sampler import ARGMAX_CHUNK, Sampler, SamplingBatch, argmax_rows
from meshserve.sampling import SamplingParams

VOCAB = 1000


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def sample(sampler: Sampler, x: torch.Tensor, params: list[SamplingParams], generators=None) -> list[int]:
    generators = generators or [None] * len(params)
    return sampler(x, SamplingBatch.build(params, generators, VOCAB)).token_ids.tolist()


def test_greedy_is_exact_argmax_first_index_on_ties():
    x = logits(4)
    x[2, 10] = x[2, 20] = x[2].max() + 1.0  # a tie: the first index wins
    tokens = sample(Sampler(), x, [SamplingParams(temperature=0.0)] * 4)
    assert tokens == x.argmax(dim=-1).tolist()
    assert tokens[2] == 10


@pytest.mark.parametrize("vocab", [49152, 1000, 2 * ARGMAX_CHUNK, 2 * ARGMAX_CHUNK + 1, 100003, 7])
def test_the_chunked_argmax_gives_torchs_first_index_of_each_rows_maximum(vocab):
    """Ties inside a chunk, across chunks, between the whole chunks and the values past
    them, a maximum only in that tail, rows of one value, infinities (as nan_to_num left
    them: finite)."""
    g = torch.Generator().manual_seed(vocab)
    ties = torch.randint(-3, 4, (16, vocab), generator=g).float()  # many ties everywhere
    spread = torch.randn(16, vocab, generator=g)
    edges = torch.full((8, vocab), -1.0)
    edges[0, -1] = edges[0, 3] = 2.0  # the tail ties the body: the body's index comes first
    edges[1, -1] = 2.0  # the maximum only past the last whole chunk
    edges[2, vocab // 2] = edges[2, vocab // 2 + 1] = 2.0
    edges[3] = torch.finfo(torch.float32).min
    edges[4, vocab - 2:] = torch.finfo(torch.float32).max
    for x in (ties, spread, edges):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(edges)[:5].tolist() == [3, vocab - 1, vocab // 2, 0, vocab - 2]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_logits_are_replaced_in_the_samplers_copy_not_in_the_callers_tensor(dtype):
    """float32 logits are copied before NaN/inf are replaced; bfloat16 ones are replaced in
    their float32 copy, in place. Either way the caller's tensor keeps its NaN and inf."""
    x = logits(3, seed=8).to(dtype)
    x[0, :] = float("nan")
    x[0, 9] = 2.0
    x[1, 4] = float("inf")
    x[2, 11] = float("-inf")
    before = x.clone()
    out = Sampler()(x, SamplingBatch.build([SamplingParams(temperature=0.0, logprobs=0)] * 3, [None] * 3, VOCAB))
    assert out.token_ids.tolist() == [9, 4, before[2].float().nan_to_num(neginf=-1e30).argmax().item()]
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())


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


# -- min_p, penalties, min_tokens, logprobs ------------------------------------------

from executor.worker.sampler import Penalties, _apply_min_p, banned_tokens  # noqa: E402


def test_min_p_masks_exactly_the_tokens_below_the_threshold_after_temperature():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    x = probs.log()
    # threshold 0.25 * 0.5 = 0.125: ids 3 (0.1) and 4 (0.05) go
    masked = _apply_min_p(x, torch.tensor([0.25])).isinf().nonzero()[:, 1].tolist()
    assert masked == [3, 4]
    # at temperature 2 the probability ratios to the max are sqrt(p / 0.5): id 3 0.447, id 4 0.316;
    # min_p 0.35 masks id 4 only (at temperature 1 its threshold 0.175 masks ids 2..4)
    assert _apply_min_p(x / 2, torch.tensor([0.35])).isinf().nonzero()[:, 1].tolist() == [4]
    assert _apply_min_p(x, torch.tensor([0.35])).isinf().nonzero()[:, 1].tolist() == [2, 3, 4]
    assert not _apply_min_p(x, torch.tensor([0.0])).isinf().any()  # 0 is off
    assert _apply_min_p(x, torch.tensor([1.0])).isinf().nonzero()[:, 1].tolist() == [1, 2, 3, 4]  # argmax stays


def test_sampler_with_min_p_only_picks_allowed_tokens_and_all_of_them():
    x = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log().repeat(400, 1)
    batch = SamplingBatch.build([SamplingParams(temperature=1.0, min_p=0.25)] * 400, [None] * 400, 5)
    assert set(Sampler(seed=1)(x, batch).token_ids.tolist()) == {0, 1, 2}
    batch = SamplingBatch.build([SamplingParams(temperature=2.0, min_p=0.35)] * 400, [None] * 400, 5)
    assert set(Sampler(seed=1)(x, batch).token_ids.tolist()) == {0, 1, 2, 3}


def test_penalties_change_exactly_the_expected_logits():
    x = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -2.0]]).repeat(2, 1)
    history = [[0, 1, 2, 2, 3], [0, 1, 2, 2, 3]]  # prompt [0, 1], output [2, 2, 3]
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams()]  # row 1: no penalty
    pen = Penalties.build(params, history, [2, 2], 8)
    assert pen.rows.tolist() == [0]
    out = x.clone()
    pen.apply(out)
    # 0, 1: prompt only (repetition); 2: output x2; 3: output x1; the rest untouched
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.25 * 2 - 0.5, -3.0 * 2 - 0.25 - 0.5, 1.0, 0.0, 4.0, -2.0]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert out[1].tolist() == x[1].tolist()
    # presence/frequency only: prompt tokens untouched
    out = x[:1].clone()
    Penalties.build([SamplingParams(presence_penalty=-1.0, frequency_penalty=1.0)], history[:1], [2], 8).apply(out)
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 0.5 - 2 + 1, -3.0 - 1 + 1, 1.0, 0.0, 4.0, -2.0])
    assert Penalties.build([SamplingParams(), SamplingParams(top_k=3)], history, [2, 2], 8) is None


def _reference_penalties(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_penalties_vectorised_over_a_batch_equal_a_per_row_loop():
    g = torch.Generator().manual_seed(3)
    x = logits(5, seed=9)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(),
              SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-2.0, frequency_penalty=2.0),
              SamplingParams(frequency_penalty=1.0)]
    histories, num_prompt = [], []
    for i in range(5):
        h = torch.randint(0, 40, (30 + i,), generator=g).tolist()  # small id range: many repeats
        histories.append(h)
        num_prompt.append(10 + i)
    out = x.clone()
    Penalties.build(params, histories, num_prompt, VOCAB).apply(out)
    for i, p in enumerate(params):
        ref = _reference_penalties(x[i], histories[i][:num_prompt[i]], histories[i][num_prompt[i]:], p)
        assert torch.allclose(out[i], ref, atol=1e-5), i


def test_greedy_is_the_argmax_of_the_penalised_logits():
    x = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    batch = SamplingBatch.build([params], [None], 4, token_ids=[[1, 3]], num_prompt_tokens=[1])
    assert Sampler()(x, batch).token_ids.tolist() == [2]  # 3.0 / 1.5 = 2.0 < 2.5
    batch = SamplingBatch.build([SamplingParams(temperature=0.0, frequency_penalty=0.3)], [None], 4,
                                token_ids=[[1, 1, 1]], num_prompt_tokens=[1])
    assert Sampler()(x, batch).token_ids.tolist() == [2]  # 3.0 - 2 * 0.3 = 2.4 < 2.5


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos = frozenset({5, 7})
    p = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    assert banned_tokens(p, 0, eos) == [3, 5, 7] and banned_tokens(p, 1, eos) == [3, 5, 7]
    assert banned_tokens(p, 2, eos) == []
    assert banned_tokens(SamplingParams(min_tokens=2, stop_token_ids=(3,), ignore_eos=True), 0, eos) == [3]
    # greedy: ids 3, 5, 7 have the largest logits; masked until two outputs exist
    x = torch.tensor([[0.0, 1.0, 0.5, 9.0, 0.2, 8.0, 0.1, 7.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    for outputs, expected in (([], 1), ([1], 1), ([1, 1], 3)):
        batch = SamplingBatch.build([params], [None], 8, token_ids=[[4] + outputs], num_prompt_tokens=[1],
                                    eos_token_ids=eos)
        assert Sampler()(x, batch).token_ids.tolist() == [expected]
    # sampled rows never draw a masked id either
    rows = 200
    batch = SamplingBatch.build([SamplingParams(temperature=5.0, min_tokens=1, stop_token_ids=(3,))] * rows,
                                [None] * rows, 8, token_ids=[[4]] * rows, num_prompt_tokens=[1] * rows,
                                eos_token_ids=eos)
    drawn = set(Sampler(seed=2)(x.repeat(rows, 1), batch).token_ids.tolist())
    assert not drawn & {3, 5, 7} and len(drawn) > 2


def test_logprobs_are_raw_log_softmax_sorted_with_the_sampled_token():
    x = logits(4, seed=11)
    params = [SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0),
              SamplingParams(temperature=0.7, top_k=3, logprobs=0, seed=1),
              SamplingParams(temperature=1.0),  # no logprobs
              SamplingParams(temperature=1.0, logprobs=20, min_p=0.1)]
    batch = SamplingBatch.build(params, [None] * 4, VOCAB, token_ids=[[1, 2, 3]] * 4, num_prompt_tokens=[3] * 4)
    out = Sampler(seed=5)(x, batch)
    ref = torch.log_softmax(x, dim=-1)
    tokens = out.token_ids.tolist()
    assert out.logprobs[2] is None
    for i, k in ((0, 5), (1, 0), (3, 20)):
        lp = out.logprobs[i]
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-6)  # raw: no penalty, no temperature
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == k
        assert list(lp.top_token_ids) == ref[i].topk(k).indices.tolist() if k else True
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True) and all(v <= 0 for v in lp.top_logprobs)
    assert Sampler()(x, SamplingBatch.build([SamplingParams()] * 4, [None] * 4, VOCAB)).logprobs is None


def test_seeded_request_with_penalties_and_min_p_is_batch_invariant():
    x = logits(6, seed=12)
    seeded = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                            frequency_penalty=0.3, top_k=50, seed=99)
    history = list(range(20))

    def run(batch_rows: list[int], seeded_row: int, steps: int = 6) -> list[int]:
        sampler = Sampler(seed=7)
        generator = torch.Generator().manual_seed(seeded.seed)
        out = []
        for step in range(steps):
            params = [SamplingParams(temperature=0.9, presence_penalty=1.0 * r % 2) for r in batch_rows]
            params[seeded_row] = seeded
            gens = [None] * len(batch_rows)
            gens[seeded_row] = generator
            hist = [history[: 10 + r] for r in batch_rows]
            hist[seeded_row] = history + out
            batch = SamplingBatch.build(params, gens, VOCAB, token_ids=hist, num_prompt_tokens=[10] * len(batch_rows))
            out.append(sampler(x[batch_rows], batch).token_ids.tolist()[seeded_row])
        return out

    alone = run([0], 0)
    assert run([3, 0, 5], 1) == alone
    assert run([1, 2, 0, 4], 2) == alone
    assert len(set(alone)) > 1
