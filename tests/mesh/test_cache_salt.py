"""vLLM's ``cache_salt`` through the mesh: a salted prompt reuses prefix blocks only of
requests of its tenant with the same salt (an unsalted one as before salts existed);
the gateway's routing hashes of a salted prompt are the chain its executor reports;
an executor refuses a salt over the limit itself."""

import uuid

import grpc
import pytest

from meshserve.block_hash import cache_salt, routing_block_hashes
from meshserve.client import build_request, channel, generate
from meshserve.sampling import SamplingParams, to_proto
from meshserve.v1 import executor_pb2, executor_pb2_grpc
from tests.support.leases import signed_lease
from tests.support.mesh_harness import wait_for_condition

pytestmark = pytest.mark.model

BLOCK_SIZE = 16
PROMPT = [1000 + (i * 7919 + 271828) % 40000 for i in range(100)]  # 6 full blocks of 16, then 4 tokens
CACHED = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 96: every full block (the last token is computed anyway)


async def cached_tokens(mesh, salt: str | None) -> int:
    done = await generate(mesh.stub, build_request(PROMPT, max_tokens=1, temperature=0.0, cache_salt=salt),
                          timeout=300)
    return done.usage["cached_tokens"]


async def test_a_salted_prompt_reuses_the_prefix_of_its_own_salt_only(mesh):
    salt_a, salt_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"  # never sent before in this session
    assert CACHED == 96
    assert await cached_tokens(mesh, salt_a) == 0
    assert await cached_tokens(mesh, salt_a) == CACHED  # the same salt: its 6 blocks
    assert await cached_tokens(mesh, salt_b) == 0  # salt a's blocks are cached, not for salt b
    assert await cached_tokens(mesh, None) == 0  # nor for no salt (no other test sends this prompt)
    assert await cached_tokens(mesh, None) == CACHED  # no salt: shared as before
    assert await cached_tokens(mesh, salt_b) == CACHED


async def test_the_gateways_routing_hashes_of_a_salted_prompt_are_the_chain_its_executor_reports(
        mesh, default_engine, monkeypatch):
    core = mesh.gateway.servicer.core
    admissions = []
    admit = core.mesh.admit

    def recording_admit(admission, span):
        admissions.append(admission)
        return admit(admission, span)

    monkeypatch.setattr(core.mesh, "admit", recording_admit)
    salt = f"r-{uuid.uuid4().hex}"
    await cached_tokens(mesh, salt)
    fp = default_engine.fingerprint
    want = routing_block_hashes(PROMPT, BLOCK_SIZE, fp.model_id, fp.revision,
                                cache_salt=cache_salt("tenant", "default", salt))
    (sent,) = admissions
    assert list(sent.block_hashes) == want and len(want) == 6
    assert not set(want) & set(routing_block_hashes(PROMPT, BLOCK_SIZE, fp.model_id, fp.revision,
                                                    cache_salt="default"))  # not the tenant's unsalted chain
    index = mesh.scheduler.servicer.core.prefix_index
    await wait_for_condition(lambda: index.hit_blocks(sent.block_hashes).get("executor-0") == 6,
                             what="the executor's KV events of the salted chain")


async def test_an_executor_refuses_a_salt_over_the_limit(mesh):
    req = executor_pb2.ExecuteRequest(request_id="long-salt", prompt_token_ids=PROMPT[:20], tenant="default",
                                      lease=signed_lease(mesh, 0, "long-salt"), cache_salt="s" * 257)
    to_proto(SamplingParams(max_tokens=1, temperature=0.0), req.sampling)
    async with channel(mesh.executors[0][0].address, mesh.tls("gateway")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in executor_pb2_grpc.ExecutorStub(ch).Execute(req)]
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                       "cache_salt has 257 characters; the limit is 256")
