"""The gateway's HTTP application in process, over a scripted mesh: no sockets, no
scheduler, no executor. For the HTTP adapter's tests that need exact outputs
(a fake executor streams the token ids a test chooses) or the prompt ids a request
reached the executor with.

    mesh = ScriptedMesh(tokenizer.encode("Paris. Yes", add_special_tokens=False))
    async with app_client(tokenizer, mesh) as http:
        r = await http.post("/v1/completions", json={...})
        mesh.prompts[-1]   # the prompt ids of the last Execute
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Sequence

import httpx2 as httpx

from gateway.events import FinishReason
from gateway.generation import GatewayCore
from gateway.http.app import create_app
from gateway.mesh import Assignment, ExecutorOutput
from gateway.request import ModelInfo
from gateway.task_api import TaskAPI
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry

MODEL = ModelInfo("smollm2-135m-instruct", max_model_len=2048, vocab_size=49152, revision="r1")


class ScriptedMesh:
    """A ``MeshClient`` that assigns at once and streams ``token_ids`` to every choice,
    one token a message, the last with finish reason ``length`` (a stop string may end
    a choice before); it records each Execute's prompt ids in ``prompts``."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = tuple(token_ids)
        self.prompts: list[list[int]] = []

    async def admit(self, admission, span):
        yield Assignment("e1", "127.0.0.1:1", "lease-1", 0.0)

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span):
        self.prompts.append(list(prompt_token_ids))
        last = len(self.token_ids) - 1
        for i, tid in enumerate(self.token_ids):
            for index in range(params.n):
                yield ExecutorOutput(index, (tid,), FinishReason.LENGTH if i == last else None)

    async def renew(self, lease_id, span):
        pass

    async def release(self, lease_id, num_generated_tokens, finished, span):
        pass

    async def close(self):
        pass


@asynccontextmanager
async def app_client(tokenizer, mesh=None, model: ModelInfo = MODEL):
    """Yields an ``httpx.AsyncClient`` on the HTTP application of a core over ``mesh``
    (default: a ``ScriptedMesh`` of no tokens: for requests that never run), open mode
    (no tenants file), ready; its ``base_url`` is ``http://gateway``."""
    core = GatewayCore(tokenizer, model, mesh or ScriptedMesh(()))
    tenants = TenantRegistry.open()
    app = create_app(core, tenants, TaskAPI(core, tenants, TaskRunner(MemoryTaskStore())), lambda: True,
                     core.metrics.registry)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                     timeout=30) as client:
            yield client
    finally:
        await core.close()
