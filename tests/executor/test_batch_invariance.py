"""Case C15: batch composition does not change greedy output (fp32 path)."""

from __future__ import annotations

import random

import pytest

from meshserve.sampling import SamplingParams
from tests.support.reference import SENTENCES

pytestmark = pytest.mark.model

P_PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def _run(engine, prompt, companions_early, companions_late, late_after_steps=4):
    """P with some companions added at once and more added while P decodes; P's tokens."""
    engine.add_request("P", prompt, P_PARAMS)
    for i, (ids, n) in enumerate(companions_early):
        engine.add_request(f"early-{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens, steps = [], 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == late_after_steps:
            for i, (ids, n) in enumerate(companions_late):
                engine.add_request(f"late-{i}", ids, SamplingParams(max_tokens=n, temperature=0.0,
                                                                    ignore_eos=True))
        for out in engine.step():
            if out.request_id == "P":
                tokens += out.new_token_ids
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.num_blocks
    return tokens


def _companions(tokenizer, rng: random.Random, count: int):
    out = []
    for _ in range(count):
        length = rng.randint(5, 600)
        text = " ".join(rng.choice(SENTENCES) for _ in range(length // 8 + 2))
        out.append((tokenizer(text).input_ids[:length], rng.randint(4, 24)))
    return out


def test_batch_composition_does_not_change_greedy_output(engine, tokenizer):
    """Case C15: P alone gives R; with 7 companions of 5-600 tokens, some joining with
    P and the rest while it decodes, in 5 companion sets, P gives R every time."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain photosynthesis in two sentences."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    [alone] = engine.generate([list(prompt)], P_PARAMS)
    assert len(alone) > 0
    for seed in range(5):
        rng = random.Random(seed)
        companions = _companions(tokenizer, rng, 7)
        split = rng.randint(1, 6)  # some join with P, the rest while P decodes (prefill + decode mixed)
        assert _run(engine, list(prompt), companions[:split], companions[split:]) == alone, f"companion set {seed}"
