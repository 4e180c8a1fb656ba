"""Golden outputs through the whole mesh: 16 prompts (raw text and chat) of 5 to 600
tokens sent at once, greedy, max_tokens 64, ignore_eos; token ids equal to
transformers' own ``generate`` run one prompt at a time in float32."""

import asyncio

import pytest

from meshserve.client import build_request, generate
from tests.support.reference import (MESH_GOLDEN_MAX_TOKENS as MAX_TOKENS, HFReference, assert_greedy_matches,
                                     cached_reference, mesh_prompts)

pytestmark = pytest.mark.model


async def test_golden_outputs_through_the_mesh(mesh, tokenizer, default_model_files):
    cases = mesh_prompts(tokenizer)
    lengths = [len(ids) for _, ids in cases]
    assert min(lengths) <= 40 and 560 <= max(lengths) <= 640, lengths
    reqs = [build_request(**kw, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) for kw, _ in cases]
    outs = await asyncio.gather(*(generate(mesh.stub, r) for r in reqs))
    for (_, expected_ids), out in zip(cases, outs):
        assert out.prompt_token_ids == expected_ids  # the gateway tokenized exactly like transformers
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
    prompts = [ids for _, ids in cases]
    key = {"model": default_model_files.model_id, "revision": default_model_files.revision, "prompts": prompts,
           "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
    refs = cached_reference(key, lambda: HFReference(default_model_files.path).greedy_many(prompts, MAX_TOKENS))
    assert_greedy_matches([o.token_ids for o in outs], refs, tie_tol=1e-4, max_divergent=1)
    stats = await mesh.executor_stats()
    assert stats.num_joined_running_batch > 0
    await mesh.wait_idle()
