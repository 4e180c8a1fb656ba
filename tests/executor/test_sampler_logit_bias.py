"""``logit_bias`` in the executor: the sampler adds each row's biases to its float32
logits (exactly, one indexed add over the batch) after the ``min_tokens`` mask and
before the penalties, as vLLM v1's ``LogitBiasLogitsProcessor`` does; logprobs stay
raw; a row's tokens never depend on its neighbours' biases (CPU, and CUDA where there
is one). On the default model: +100 forces a token at every greedy step, -100 on the
greedy token gives the tokens of the same token masked to -inf, and a biased request
batched with an unbiased one leaves the latter its solo tokens."""

from __future__ import annotations

import pytest
import torch

from executor.worker.sampler import Sampler, SamplingBatch
from meshserve.sampling import SamplingParams

VOCAB = 1000
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def logits(rows: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=g) * 3).to(device)


def biased_by_hand(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    out = x.clone()
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            out[i, token_id] += torch.tensor(bias, dtype=torch.float32)
    return out


def generators(seeds: list[int | None], device: str) -> list[torch.Generator | None]:
    return [None if s is None else torch.Generator(device=device).manual_seed(s) for s in seeds]


@pytest.mark.parametrize("device", DEVICES)
def test_the_bias_is_added_exactly_to_the_listed_logits_of_its_rows(device):
    """Seeded sampling and greedy on the biased logits equal the same on logits biased
    by hand with no ``logit_bias``: the bias is an exact float32 add, and nothing else."""
    x = logits(4, seed=1, device=device)
    biases = [((5, 2.5), (17, -1.0), (999, 7.25)), (), ((5, 3.0),), ((0, 0.1), (400, -60.0))]
    params = [SamplingParams(temperature=0.8, seed=10 + i, logit_bias=b) for i, b in enumerate(biases)]
    plain = [SamplingParams(temperature=0.8, seed=10 + i) for i in range(4)]
    by_hand = biased_by_hand(x, params)
    seeds = [10, 11, 12, 13]
    got = SamplingBatch.build(params, generators(seeds, device), VOCAB, device)
    want = SamplingBatch.build(plain, generators(seeds, device), VOCAB, device)
    sampler = Sampler(device=device)
    for _ in range(8):  # each step advances the same generators the same way
        assert sampler(x, got).token_ids.tolist() == sampler(by_hand, want).token_ids.tolist()
    greedy = [SamplingParams(temperature=0.0, logit_bias=b) for b in biases]
    tokens = sampler(x, SamplingBatch.build(greedy, [None] * 4, VOCAB, device)).token_ids.tolist()
    assert tokens == by_hand.argmax(dim=-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_plus_100_forces_a_token_and_minus_100_removes_the_greedy_one(device):
    x = logits(3, seed=2, device=device)
    best = x.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0.0, logit_bias=((123, 100.0),)),
              SamplingParams(temperature=0.0, logit_bias=((best[1], -100.0),)),
              SamplingParams(temperature=0.0)]
    tokens = Sampler(device=device)(x, SamplingBatch.build(params, [None] * 3, VOCAB, device)).token_ids.tolist()
    masked = x[1].clone()
    masked[best[1]] = float("-inf")
    assert tokens == [123, masked.argmax().item(), best[2]]


def test_the_min_tokens_mask_wins_over_a_bias_and_the_bias_comes_before_the_penalties():
    """vLLM v1's order: min_tokens mask, logit bias, penalties. A masked id stays -inf
    whatever its bias; the repetition penalty divides or multiplies the *biased* logit:
    token 0 (in the prompt, raw 3.0, bias -4) is -1.0 * 2 = -2.0 > -2.2 (penalty first
    would give 3.0 / 2 - 4 = -2.5 < -2.2)."""
    x = torch.full((1, 8), -2.2)
    x[0, 0], x[0, 3] = 3.0, 9.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, min_tokens=1, stop_token_ids=(3,),
                            logit_bias=((0, -4.0), (3, 100.0)))
    batch = SamplingBatch.build([params], [None], 8, token_ids=[[0]], num_prompt_tokens=[1])
    assert Sampler()(x, batch).token_ids.tolist() == [0]
    after_min_tokens = SamplingBatch.build([params], [None], 8, token_ids=[[0, 1]], num_prompt_tokens=[1])
    assert Sampler()(x, after_min_tokens).token_ids.tolist() == [3]  # 9 + 100: no longer masked


def test_logprobs_are_the_raw_ones_not_the_biased_ones():
    x = logits(2, seed=3)
    params = [SamplingParams(temperature=0.0, logprobs=5, logit_bias=((42, 100.0), (7, -100.0))),
              SamplingParams(temperature=0.0, logprobs=5)]
    out = Sampler()(x, SamplingBatch.build(params, [None] * 2, VOCAB))
    raw = torch.log_softmax(x, dim=-1)
    assert out.token_ids.tolist() == [42, x[1].argmax().item()]
    for i in range(2):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i].item()
        assert lp.logprob == raw[i, lp.token_id].item()
        assert list(lp.top_token_ids) == raw[i].topk(5).indices.tolist()
        assert list(lp.top_logprobs) == raw[i].topk(5).values.tolist()
    assert out.logprobs[0].logprob < -5  # the forced token's own, unbiased probability


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_never_depends_on_its_neighbours_biases(device):
    x = logits(6, seed=4, device=device)
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=77, logit_bias=((3, 4.0), (8, -2.0)))

    def run(rows: list[int], at: int, neighbours: list[SamplingParams], steps: int = 6) -> list[int]:
        sampler = Sampler(seed=5, device=device)
        generator = torch.Generator(device=device).manual_seed(mine.seed)
        out = []
        for _ in range(steps):
            params = list(neighbours)
            params.insert(at, mine)
            gens = [None] * len(params)
            gens[at] = generator
            out.append(sampler(x[rows], SamplingBatch.build(params, gens, VOCAB, device)).token_ids[at].item())
        return out

    alone = run([0], 0, [])
    biased = [SamplingParams(temperature=1.0, logit_bias=((3, -50.0), (9, 30.0))), SamplingParams(temperature=0.0)]
    assert run([2, 0, 5], 1, biased) == alone
    many = SamplingParams(temperature=0.0, logit_bias=tuple((i, 1.0) for i in range(300)))
    assert run([0, 1, 2], 0, [many, biased[1]]) == alone
    assert len(set(alone)) > 1
    greedy = SamplingParams(temperature=0.0)  # an unbiased greedy row beside biased ones: its own argmax
    tokens = Sampler(device=device)(x[:3], SamplingBatch.build([biased[0], greedy, biased[0]], [None] * 3, VOCAB,
                                                               device)).token_ids.tolist()
    assert tokens[1] == x[1].argmax().item()


# -- on the default model ----------------------------------------------------------------

def run_together(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """The requests added before the first step (so they are batched), their tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer("The three primary colours are red, yellow and").input_ids


@pytest.mark.model
def test_greedy_with_plus_100_gives_the_token_at_every_step(engine, tokenizer):
    prompt = prompt_ids(tokenizer)
    [free] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    token = next(t for t in range(1000, 2000) if t not in free)
    [forced] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                        logit_bias=((token, 100.0),)))
    assert forced == [token] * 8


@pytest.mark.model
def test_minus_100_on_the_greedy_token_equals_masking_it(engine, tokenizer):
    """The reference masks the token to -inf at every step with the min_tokens ban
    (a stop token id, min_tokens = max_tokens; ignore_eos so that only it is masked)."""
    prompt = prompt_ids(tokenizer)
    common = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    [free] = engine.generate([prompt], SamplingParams(**common))
    token = free[0]
    [biased] = engine.generate([prompt], SamplingParams(**common, logit_bias=((token, -100.0),)))
    [masked] = engine.generate([prompt], SamplingParams(**common, stop_token_ids=(token,), min_tokens=12))
    assert biased == masked
    assert token not in biased and biased != free


@pytest.mark.model
def test_a_biased_neighbour_leaves_an_unbiased_request_its_solo_tokens_and_raw_logprobs(engine, tokenizer):
    prompt = prompt_ids(tokenizer)
    other = tokenizer("Paged attention stores keys and values in").input_ids
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True)
    biased = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3,
                            logit_bias=((1234, 100.0), (4, -100.0), (5, 50.0)))
    solo = {rid: run_together(engine, {rid: r})[rid] for rid, r in
            (("plain", (prompt, plain)), ("seeded", (other, seeded)), ("biased", (prompt, biased)))}
    together = run_together(engine, {"plain": (prompt, plain), "biased": (prompt, biased),
                                     "seeded": (other, seeded)})
    assert together == solo
    assert solo["biased"] == [1234] * 10 and solo["plain"] != solo["biased"]
    # the forced token's logprobs are the raw ones: those the model gives it after the same
    # tokens, read from a prompt of them (prompt logprobs: the prefill's path, hence the tolerance)
    engine.add_request("ref", prompt + solo["biased"], SamplingParams(max_tokens=1, temperature=0.0,
                                                                      prompt_logprobs=3))
    engine.add_request("biased", prompt, biased)
    outs: dict[str, list] = {"ref": [], "biased": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    ref = outs["ref"][0].prompt_logprobs[len(prompt) - 1:]
    entries = [lp for out in outs["biased"] for lp in out.logprobs]
    assert len(entries) == len(ref) == 10
    for entry, want in zip(entries, ref):
        assert entry.token_id == want.token_id == 1234
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4) and entry.logprob < -1
        assert entry.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-4)
