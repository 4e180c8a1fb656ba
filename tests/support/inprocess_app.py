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
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Sequence

import httpx2 as httpx

from gateway.events import FinishReason, TokenLogprob, TopLogprob
from gateway.generation import GatewayCore
from gateway.http.app import create_app
from gateway.mesh import Assignment, ExecutorOutput
from gateway.request import ModelInfo
from gateway.task_api import TaskAPI
from gateway.task_runner import TaskRunner
from gateway.task_store import MemoryTaskStore
from gateway.tenants import TenantRegistry

MODEL = ModelInfo("smollm2-135m-instruct", max_model_len=2048, vocab_size=49152, revision="r1")
ALTERNATIVE_IDS = range(49000, 49020)  # the scripted top k's other tokens (no prompt of the tests holds them)


def scripted_prompt_logprobs(prompt_token_ids: Sequence[int], k: int) -> tuple[TokenLogprob, ...]:
    """The prompt logprobs ``ScriptedMesh`` sends (every value exact in float32, as the
    wire carries it), one per position i = 1 …: at an even i the prompt's token, logprob
    -i/8, leads its top k (then ``ALTERNATIVE_IDS``, each 1/4 less likely than the one
    before); at an odd i the top k are ``ALTERNATIVE_IDS`` (-1/4, -2/4 …) and the
    prompt's token, at -(k + 1)/4 - i/8, is outside them."""
    out = []
    for i, tid in enumerate(prompt_token_ids[1:], 1):
        if i % 2 == 0:
            own = -i / 8
            top = [TopLogprob(tid, own)] + [TopLogprob(a, own - (j + 1) / 4) for j, a in enumerate(ALTERNATIVE_IDS)]
        else:
            own = -(k + 1) / 4 - i / 8
            top = [TopLogprob(a, -(j + 1) / 4) for j, a in enumerate(ALTERNATIVE_IDS)]
        out.append(TokenLogprob(tid, own, tuple(top[:k])))
    return tuple(out)


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
        k = params.prompt_logprobs
        for i, tid in enumerate(self.token_ids):
            for index in range(params.n):
                first = i == 0 and index == 0 and k is not None  # choice 0's first message, as an executor
                prompt_logprobs = scripted_prompt_logprobs(prompt_token_ids, k) if first else ()
                yield ExecutorOutput(index, (tid,), FinishReason.LENGTH if i == last else None,
                                     prompt_logprobs=prompt_logprobs)

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
