"""gateway.generation.GatewayCore without a transport adapter: ``prepare``'s
validation (exact error types and messages), the request id's claim and release,
the metrics of rejected requests, and a run whose scheduler is unreachable (the
real gRPC mesh client to a closed port), a caller that goes away between the
scheduler's assignment and the end of its Admit stream, and the tokens a release
reports (fake mesh clients). Runs over a real mesh: tests/gateway/test_generation_mesh.py."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
import pytest_asyncio

from gateway.events import ChoiceResult, Delta, FinishReason, Queued
from gateway.generation import GatewayCore
from gateway.mesh import Assignment, ExecutorOutput, RefusedByMesh
from gateway.mesh_client import GrpcMeshClient
from gateway.preparation import RUNNING_GRACE_S
from gateway.request import GenerationRequest, ModelInfo, SpanOptions
from gateway.result_cache import ResultCache, cache_key
from gateway.tenants import Tenant
from meshserve.errors import AlreadyExists, InvalidArgument, ModelNotFound, ResourceExhausted, Unavailable
from meshserve.sampling import SamplingParams
from meshserve.telemetry import memory_exporter
from tests.support.redis_server import free_port

MODEL = ModelInfo("test-model", max_model_len=64, vocab_size=49152, revision="r1")
TENANT = Tenant("acme", default_priority=3)


@pytest_asyncio.fixture
async def core(tokenizer):
    c = GatewayCore(tokenizer, MODEL, GrpcMeshClient(f"127.0.0.1:{free_port()}"),
                    result_cache=ResultCache(8, ttl_s=60.0))
    yield c
    await c.close()


def count(core: GatewayCore, name: str, **labels) -> float:
    return core.metrics.registry.get_sample_value(name, {"tenant": "acme", "priority": "3", **labels}) or 0.0


@pytest.mark.parametrize("request_, error, message", [
    (GenerationRequest(), InvalidArgument, "one of prompt, chat or prompt_token_ids must be set"),
    (GenerationRequest(prompt="Hi", prompt_token_ids=(1, 2)), InvalidArgument,
     "only one of prompt, chat or prompt_token_ids may be set, got prompt, prompt_token_ids"),
    (GenerationRequest(prompt=""), InvalidArgument, "prompt must not be empty"),
    (GenerationRequest(prompt_token_ids=()), InvalidArgument, "prompt_token_ids must not be empty"),
    (GenerationRequest(prompt_token_ids=(1, 49152)), InvalidArgument,
     "prompt_token_ids[1] = 49152 is outside the vocabulary [0, 49152)"),
    (GenerationRequest(chat=(("robot", "Hi"),)), InvalidArgument,
     "chat.messages[0].role must be one of system, user, assistant, developer, got 'robot'"),
    (GenerationRequest(prompt="Hi", sampling=SamplingParams(top_p=0.0)), InvalidArgument,
     "top_p must be in (0, 1], got 0.0"),
    (GenerationRequest(prompt="Hi", sampling=SamplingParams(max_tokens=65)), InvalidArgument,
     "max_tokens must be in [1, 64] (max_model_len), got 65"),
    (GenerationRequest(prompt_token_ids=tuple(range(64))), InvalidArgument,
     "prompt has 64 tokens; max_model_len is 64 (prompt + at least 1 output token)"),
    (GenerationRequest(prompt="Hi", model="other"), ModelNotFound,
     "model 'other' is not served here (this gateway serves 'test-model')"),
])
async def test_prepare_rejects_with_the_exact_error(core, request_, error, message):
    with pytest.raises(error) as info:
        core.prepare(request_, TENANT)
    assert type(info.value) is error and str(info.value) == message
    assert count(core, "meshserve_requests_total", outcome=error.code.name.lower()) == 1
    assert count(core, "meshserve_gateway_requests_running") == 0


async def test_prepare_claims_the_request_id_until_end(core):
    p = core.prepare(GenerationRequest(prompt_token_ids=(5, 6, 7), request_id="r1"), TENANT)
    assert (p.request_id, p.tenant, p.priority, p.prompt_ids, p.operation) == ("r1", "acme", 3, [5, 6, 7],
                                                                               "text_completion")
    assert p.params == SamplingParams() and p.cache_key is None  # temperature 1, no seed: not deterministic
    with pytest.raises(AlreadyExists) as info:
        core.prepare(GenerationRequest(prompt="Hi", request_id="r1"), TENANT)
    assert str(info.value) == "request_id 'r1' is already in use by an unfinished request"
    core.end(p)
    again = core.prepare(GenerationRequest(prompt="Hi", request_id="r1", priority=0), TENANT)
    core.end(p)  # a second end of the first request frees nothing
    with pytest.raises(AlreadyExists):
        core.prepare(GenerationRequest(prompt="Hi", request_id="r1"), TENANT)
    assert again.priority == 0 and again.operation == "text_completion"
    core.end(again)
    assert count(core, "meshserve_requests_total", outcome="ok") == 1
    assert count(core, "meshserve_requests_total", outcome="already_exists") == 2


async def test_deterministic_requests_get_the_result_cache_key(core):
    greedy = SamplingParams(temperature=0.0, top_k=-1, max_tokens=4)
    p = core.prepare(GenerationRequest(chat=(("user", "Hi"),), sampling=greedy), TENANT)
    assert p.operation == "chat" and len(p.request_id) == 32
    assert p.params == SamplingParams(temperature=0.0, top_k=0, max_tokens=4)  # validated: top_k -1 is off
    assert p.cache_key == cache_key("test-model", "r1", p.prompt_ids, p.params, scope="tenant:acme")
    core.end(p)


async def test_a_run_whose_scheduler_is_gone_raises_unavailable_and_ends_once(core):
    memory_exporter().clear()
    events = []
    with pytest.raises(Unavailable) as info:
        async for event in core.generate(GenerationRequest(prompt="Hi", request_id="r2"), TENANT,
                                         SpanOptions(stream=False, attributes={"meshserve.task_id": "t1"})):
            events.append(event)
    assert events == [] and str(info.value).startswith("scheduler: ")
    (span,) = [s for s in memory_exporter().get_finished_spans() if s.attributes.get("meshserve.request_id") == "r2"]
    assert span.name == "text_completion test-model" and span.status.status_code.name == "ERROR"
    assert (span.attributes["meshserve.task_id"], span.attributes["gen_ai.request.stream"]) == ("t1", False)
    assert count(core, "meshserve_requests_total", outcome="unavailable") == 1
    p = core.prepare(GenerationRequest(prompt="Hi", request_id="r2"), TENANT)  # the id is free again
    with pytest.raises(Unavailable):
        async for _ in core.run(p):
            pass
    assert p.ended and count(core, "meshserve_requests_total", outcome="unavailable") == 2
    assert count(core, "meshserve_gateway_requests_running") == 0


class StalledAfterAssignment:
    """A ``MeshClient`` whose scheduler sends a queue update and the assignment, then
    holds the Admit stream open (its end never comes); it records each release."""

    def __init__(self) -> None:
        self.assigned = asyncio.Event()
        self.releases: list[tuple[str, int | None, bool]] = []

    async def admit(self, admission, span):
        yield Queued(0, 0.0)
        yield Assignment("e1", "127.0.0.1:1", "lease-1", 0.0)
        self.assigned.set()
        await asyncio.Event().wait()  # the scheduler has not ended the stream yet

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span, cache_salt=""):
        raise AssertionError("never reached")
        yield  # an async generator

    async def release(self, lease_id, num_generated_tokens, finished, span):
        self.releases.append((lease_id, num_generated_tokens, finished))

    async def close(self):
        pass


async def test_a_caller_gone_after_the_assignment_releases_the_lease(tokenizer):
    mesh = StalledAfterAssignment()
    core = GatewayCore(tokenizer, MODEL, mesh)

    async def consume():
        async for _ in core.generate(GenerationRequest(prompt_token_ids=(5, 6, 7), request_id="r3"), TENANT):
            pass

    task = asyncio.create_task(consume())
    await mesh.assigned.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert mesh.releases == [("lease-1", None, False)]
    assert count(core, "meshserve_requests_total", outcome="cancelled") == 1
    assert count(core, "meshserve_gateway_requests_running") == 0
    core.end(core.prepare(GenerationRequest(prompt="Hi", request_id="r3"), TENANT))  # the id is free again


class AdmitEndsWith(StalledAfterAssignment):
    """A ``MeshClient`` whose Admit call fails with ``error`` before the gateway read an assignment."""

    def __init__(self, error) -> None:
        super().__init__()
        self.error = error
        self.proposed: list[str] = []

    async def admit(self, admission, span):
        self.proposed.append(admission.lease_id)
        yield Queued(0, 0.0)
        raise self.error


@pytest.mark.parametrize("error, released", [
    (Unavailable("scheduler: Stream removed (Socket closed)"), True),  # the connection broke: a grant may be on it
    (ResourceExhausted("scheduler: displaced"), False),  # the scheduler's refusal: it holds nothing
    (RefusedByMesh("scheduler refused the call (PERMISSION_DENIED): unknown tenant 't'"), False),  # nor here
])
async def test_an_admit_lost_with_its_connection_releases_the_proposed_id(tokenizer, error, released):
    mesh = AdmitEndsWith(error)
    core = GatewayCore(tokenizer, MODEL, mesh)
    with pytest.raises(type(error)):
        async for _ in core.generate(GenerationRequest(prompt_token_ids=(5, 6, 7), request_id="r4"), TENANT):
            pass
    assert mesh.releases == ([(mesh.proposed[0], None, False)] if released else [])


class Streams(StalledAfterAssignment):
    """A ``MeshClient`` that assigns at once, then streams choice 0 one token a message:
    ``length`` tokens, the last with finish reason ``length``."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    async def admit(self, admission, span):
        yield Assignment("e1", "127.0.0.1:1", "lease-1", 0.0)

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span, cache_salt=""):
        for i in range(self.length):
            yield ExecutorOutput(0, (100 + i,), FinishReason.LENGTH if i == self.length - 1 else None)


async def test_a_finished_request_releases_its_tokens_as_finished(tokenizer):
    mesh = Streams(6)
    core = GatewayCore(tokenizer, MODEL, mesh)
    request = GenerationRequest(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=6), request_id="r5")
    async for _ in core.generate(request, TENANT):
        pass
    assert mesh.releases == [("lease-1", 6, True)]


async def test_a_caller_gone_mid_stream_releases_the_tokens_generated_so_far(tokenizer):
    """The tenant's tokens_per_min is charged for what was generated, finished or not:
    leaving mid-stream does not make the completion free."""
    mesh = Streams(40)
    core = GatewayCore(tokenizer, MODEL, mesh)
    deltas = 0
    request = GenerationRequest(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=40), request_id="r6")
    async with aclosing(core.generate(request, TENANT)) as events:
        async for event in events:
            deltas += isinstance(event, Delta)
            if deltas == 3:
                break  # the caller goes away after its third delta
    assert len(mesh.releases) == 1
    lease_id, generated, finished = mesh.releases[0]
    assert (lease_id, finished) == ("lease-1", False)
    assert generated == 3  # the gateway had read three tokens when the stream closed


class TwoChoices(StalledAfterAssignment):
    """A ``MeshClient`` that assigns at once, then streams two choices one token a
    message, interleaved, each ending with finish reason ``length``."""

    def __init__(self, first: list[int], second: list[int]) -> None:
        super().__init__()
        self.choices = (first, second)

    async def admit(self, admission, span):
        yield Assignment("e1", "127.0.0.1:1", "lease-1", 0.0)

    async def execute(self, assignment, request_id, prompt_token_ids, params, priority, span, cache_salt=""):
        for i in range(max(map(len, self.choices))):
            for index, ids in enumerate(self.choices):
                if i < len(ids):
                    yield ExecutorOutput(index, (ids[i],), FinishReason.LENGTH if i == len(ids) - 1 else None)


async def test_tokens_after_a_choices_stop_string_are_charged_too(tokenizer):
    """Found by a review: with n = 2, the tokens the executor kept generating for a choice
    a stop string had ended (it runs until every choice ends) were not charged."""
    first = tokenizer.encode("Yes. and then some more words follow here", add_special_tokens=False)
    second = tokenizer.encode(" one two three four five six seven eight nine ten eleven", add_special_tokens=False)
    assert len(second) > len(first)  # every token of the first is read before the second ends
    mesh = TwoChoices(first, second)
    core = GatewayCore(tokenizer, MODEL, mesh)
    request = GenerationRequest(prompt_token_ids=(5, 6, 7), request_id="r7",
                                sampling=SamplingParams(n=2, max_tokens=16, stop=(".",)))
    results = [e async for e in core.generate(request, TENANT) if isinstance(e, ChoiceResult)]
    assert sorted(r.usage.completion_tokens for r in results)[0] < len(first)  # choice 0 was cut at "."
    assert mesh.releases == [("lease-1", len(first) + len(second), True)]


class SlowRelease(Streams):
    """``Streams`` whose Release calls wait until ``released`` is set (a scheduler slow
    to answer), each recorded once it returns."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.released = asyncio.Event()
        self.releasing = asyncio.Event()

    async def release(self, lease_id, num_generated_tokens, finished, span):
        self.releasing.set()
        await self.released.wait()
        await super().release(lease_id, num_generated_tokens, finished, span)


async def test_a_retry_under_the_id_of_a_cancelled_request_waits_for_its_end_instead_of_being_refused(tokenizer):
    """Found by a review: a caller that cancels (or whose deadline passes) and retries at
    once under the same request_id got ALREADY_EXISTS while the old request released its
    lease, or before the gateway saw the old call end. The retry now waits for that end
    (the id is freed after the Release), then runs; an id whose request is still running
    after ``RUNNING_GRACE_S`` is refused."""
    mesh = SlowRelease(40)
    core = GatewayCore(tokenizer, MODEL, mesh)
    request = GenerationRequest(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=40), request_id="r8")
    running = aclosing(core.generate(request, TENANT))
    events = await running.__aenter__()
    await anext(events)  # the first delta: the request runs
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(AlreadyExists):  # a second request under a running request's id
        async for _ in core.generate(request, TENANT):
            pass
    assert loop.time() - started >= RUNNING_GRACE_S
    again = core.generate(request, TENANT)
    retry = asyncio.create_task(anext(again))  # sent before the gateway sees the first call end...
    closing = asyncio.create_task(running.__aexit__(None, None, None))  # ... which it does just after
    # (both start in one turn of the loop, the retry first: a stall of the host after it, longer than
    # the grace, cannot come between the retry's wait and the old request's end)
    await mesh.releasing.wait()
    await asyncio.sleep(2 * RUNNING_GRACE_S)  # past the grace: only the ending mark keeps it waiting
    assert not retry.done()  # waiting for the old request's end, not refused
    mesh.released.set()
    await closing
    assert isinstance(await retry, Delta)
    await again.aclose()
    assert mesh.releases == [("lease-1", 1, False), ("lease-1", 1, False)]
