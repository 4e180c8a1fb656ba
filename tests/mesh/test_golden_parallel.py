"""The golden test through a mesh of processes, as ``meshserve up
--tensor-parallel-size 3`` and ``meshserve up --pipeline-parallel-size 2`` start
it: the executor's model spread over 3 tensor-parallel ranks or 2 pipeline
stages; the 16 golden prompts' greedy tokens equal to transformers' (the same
near-tie rule as ``test_golden.py``)."""

from __future__ import annotations

import asyncio

import pytest

from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh import mesh_config, parallel_args
from meshserve.client import build_request, channel, generate
from meshserve.v1 import gateway_pb2_grpc
from tests.support.reference import (MESH_GOLDEN_MAX_TOKENS as MAX_TOKENS, HFReference, assert_greedy_matches,
                                     cached_reference, mesh_prompts)

pytestmark = pytest.mark.model


@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)], ids=["tensor-parallel-3", "pipeline-parallel-2"])
async def test_golden_outputs_through_a_parallel_mesh(tp, pp, tokenizer, default_model_files, tmp_path):
    extra = ["--max-model-len", "1024", "--max-num-batched-tokens", "512", *parallel_args(tp, pp)]
    mesh = Mesh(mesh_config(0, 1, "default", "float32", "256MiB", extra, None, str(tmp_path)))
    await mesh.start()
    try:
        cases = mesh_prompts(tokenizer)
        reqs = [build_request(**kw, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) for kw, _ in cases]
        async with channel(mesh.gateway_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            outs = await asyncio.gather(*(generate(stub, r) for r in reqs))
        for (_, expected_ids), out in zip(cases, outs):
            assert out.prompt_token_ids == expected_ids
            assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
        prompts = [ids for _, ids in cases]
        key = {"model": default_model_files.model_id, "revision": default_model_files.revision, "prompts": prompts,
               "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
        refs = cached_reference(key, lambda: HFReference(default_model_files.path).greedy_many(prompts, MAX_TOKENS))
        assert_greedy_matches([o.token_ids for o in outs], refs, tie_tol=1e-4, max_divergent=1)
        assert mesh.exited() == []  # no service (and so no rank: the executor exits with a rank) died
    finally:
        mesh.stop()
