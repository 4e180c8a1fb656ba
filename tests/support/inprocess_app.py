"""The gateway's HTTP application in process, over a scripted mesh: no sockets, no
scheduler, no executor. For the HTTP adapter's tests that need exact outputs
(a fake executor streams the token ids a test chooses) or the prompt ids a request
reached the executor with.

    mesh = ScriptedMesh(tokenizer.encode("Paris. Yes", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json={...})
        mesh.prompts[-1]   # the prompt ids of the last Execute

With ``prompt_logprobs`` asked, choice 0's first message carries
``scripted_prompt_logprobs`` of its prompt, as an executor sends the core's.
``gateway_clients`` adds the gRPC servicer of the same core on a loopback port, for
tests that compare what the two adapters send the executor.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Sequence

import httpx2 as httpx

from gateway.events import FinishReason, TokenLogprob, TopLogprob
from gateway.generation import GatewayCore
from gateway.http.app import create_app
from gateway.mesh import Admission, Assignment, ExecutorOutput
from gateway.request import ModelInfo
from gateway.server import GatewayServicer
from gateway.task_api import TaskAPI
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry
from meshserve.grpc_server import Service, open_channel
from meshserve.v1 import gateway_pb2_grpc

MODEL = ModelInfo("smollm2-135m-instruct", max_model_len=2048, vocab_size=49152, revision="r1")
ALTERNATIVE_IDS = range(49000, 49020)  # the scripted top k's other tokens (no prompt of the tests holds them)


def scripted_prompt_logprobs(prompt_token_ids: Sequence[int], k: int) -> tuple[TokenLogprob, ...]:
    """The prompt logprobs ``ScriptedMesh`` sends (every value exact in float32, as the
    wire carries it), one per position i = 1 …: at an even i the prompt's token, logprob
    -i/8, leads its top k (then ``ALTERNATIVE_IDS``, each 1/4 less likely than the one
    before; its rank 1); at an odd i the top k are ``ALTERNATIVE_IDS`` (-1/4, -2/4 …) and
    the prompt's token, at -(k + 1)/4 - i/8, is outside them (its rank k + 1 + i)."""
    out = []
    for i, tid in enumerate(prompt_token_ids[1:], 1):
        if i % 2 == 0:
            own, rank = -i / 8, 1
            top = [TopLogprob(tid, own)] + [TopLogprob(a, own - (j + 1) / 4) for j, a in enumerate(ALTERNATIVE_IDS)]
        else:
            own, rank = -(k + 1) / 4 - i / 8, k + 1 + i
            top = [TopLogprob(a, -(j + 1) / 4) for j, a in enumerate(ALTERNATIVE_IDS)]
        out.append(TokenLogprob(tid, own, tuple(top[:k]), rank))
    return tuple(out)


class ScriptedMesh:
    """A ``MeshClient`` that assigns at once and streams ``token_ids`` to every choice,
    one token a message (with ``logprobs`` asked, each token's: -1/4, its own top 1),
    the last with ``finish_reason`` (default ``length``; ``stop``
    as an executor ends a choice on an EOS or one of ``stop_token_ids``; a stop string
    may end a choice before); it records each Execute's prompt ids in ``prompts``, its
    ``cache_salt`` in ``cache_salts`` and its ``SamplingParams`` in ``params``, and each
    ``Admission`` in ``admissions``."""

    def __init__(self, token_ids: Sequence[int], finish_reason: FinishReason = FinishReason.LENGTH) -> None:
        self.token_ids = tuple(token_ids)
        self.finish_reason = finish_reason
        self.prompts: list[list[int]] = []
        self.cache_salts: list[str] = []
        self.params: list = []
        self.admissions: list[Admission] = []

    async def admit(self, admission, span):
        self.admissions.append(admission)
        yield Assignment("e1", "127.0.0.1:1", "lease-1", 0.0)

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span, cache_salt=""):
        self.prompts.append(list(prompt_token_ids))
        self.cache_salts.append(cache_salt)
        self.params.append(params)
        last = len(self.token_ids) - 1
        k = params.prompt_logprobs
        for i, tid in enumerate(self.token_ids):
            for index in range(params.n):
                first = i == 0 and index == 0 and k is not None  # choice 0's first message, as an executor
                prompt_logprobs = scripted_prompt_logprobs(prompt_token_ids, k) if first else ()
                logprobs = () if params.logprobs is None else (
                    TokenLogprob(tid, -0.25, (TopLogprob(tid, -0.25),)[:params.logprobs]),)
                yield ExecutorOutput(index, (tid,), self.finish_reason if i == last else None,
                                     logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    async def renew(self, lease_id, span):
        pass

    async def release(self, lease_id, num_generated_tokens, finished, span):
        pass

    async def close(self):
        pass


@asynccontextmanager
async def app_client(tokenizer, mesh=None, model: ModelInfo = MODEL, result_cache=None):
    """Yields an ``httpx.AsyncClient`` on the HTTP application of a core over ``mesh``
    (default: a ``ScriptedMesh`` of no tokens: for requests that never run), open mode
    (no tenants file), ready; its ``base_url`` is ``http://gateway``. ``result_cache``:
    the core's (``GatewayCore``'s argument; default none)."""
    async with gateway_clients(tokenizer, mesh, model, grpc=False, result_cache=result_cache) as (client, _):
        yield client


@asynccontextmanager
async def gateway_clients(tokenizer, mesh=None, model: ModelInfo = MODEL, grpc: bool = True, result_cache=None):
    """Yields ``(http, stub)`` over one core on ``mesh``, as ``app_client``: the HTTP
    client, and with ``grpc`` a ``GatewayStub`` on a loopback gRPC server of the same
    core (plaintext, the gateway's servicer and error interceptor; None without)."""
    core = GatewayCore(tokenizer, model, mesh or ScriptedMesh(()), result_cache=result_cache)
    tenants = TenantRegistry.open()
    tasks = TaskAPI(core, tenants, TaskRunner(MemoryTaskStore()))
    app = create_app(core, tenants, tasks, lambda: True, core.metrics.registry)
    service = channel = None
    try:
        stub = None
        if grpc:
            service = Service("meshserve.v1.Gateway", 0, public=True)
            gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(core, tenants, tasks), service.server)
            await service.start()
            channel = open_channel(f"127.0.0.1:{service.port}")
            stub = gateway_pb2_grpc.GatewayStub(channel)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                     timeout=30) as client:
            yield client, stub
    finally:
        if channel is not None:
            await channel.close()
        if service is not None:
            await service.stop(0)
        await core.close()


async def finished_task(http, body: dict, polls: int = 2000) -> dict:
    """Submits ``body`` to ``POST /v1/tasks`` and returns its ``TaskStatus`` (JSON) once
    final (``polls`` bounds a hang, 10 ms apart).

    Raises:
        AssertionError: the submit was not accepted, or the task did not finish.
    """
    r = await http.post("/v1/tasks", json=body)
    assert r.status_code == 202, r.text
    for _ in range(polls):
        status = (await http.get(f"/v1/tasks/{r.json()['task_id']}")).json()
        if status["state"] not in ("TASK_STATE_QUEUED", "TASK_STATE_RUNNING"):
            return status
        await asyncio.sleep(0.01)
    raise AssertionError(f"task not finished: {status}")
