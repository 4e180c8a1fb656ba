"""A stand-in gateway that serves only the async-task calls, for client tests with no
model: ``SubmitTask`` names a task for its prompt (``task-PROMPT``, whatever order
concurrent submits arrive in); ``GetTask`` says RUNNING while ``done`` is False, else
SUCCEEDED with choices ``answer I to PROMPT``."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc

from meshserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


class TaskGateway(gateway_pb2_grpc.GatewayServicer):
    """Attributes: ``address`` (once served), ``requests`` (in the order they arrived),
    ``done`` (whether ``GetTask`` reports the tasks finished), ``polls`` (GetTask calls)."""

    def __init__(self, done: bool = True):
        self.address = ""
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.done = done
        self.polls = 0

    async def SubmitTask(self, request, context):
        self.requests.append(request)
        return gateway_pb2.TaskHandle(task_id=f"task-{request.prompt}", state=gateway_pb2.TASK_STATE_QUEUED)

    async def GetTask(self, request, context):
        self.polls += 1
        if not self.done:
            return gateway_pb2.TaskStatus(task_id=request.task_id, state=gateway_pb2.TASK_STATE_RUNNING)
        submitted = next(r for r in self.requests if f"task-{r.prompt}" == request.task_id)
        choices = [gateway_pb2.TaskChoice(
            index=i, text=f"answer {i} to {submitted.prompt}", token_ids=[7, 8, 9],
            result=gateway_pb2.GenerateResult(finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                              usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=3)))
            for i in range(submitted.sampling.n or 1)]
        return gateway_pb2.TaskStatus(task_id=request.task_id, state=gateway_pb2.TASK_STATE_SUCCEEDED,
                                      choices=choices)


@asynccontextmanager
async def task_gateway(done: bool = True) -> AsyncIterator[TaskGateway]:
    """Serves a ``TaskGateway`` in plaintext on a free loopback port; stops it after."""
    servicer = TaskGateway(done)
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    servicer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield servicer
    finally:
        await server.stop(None)
