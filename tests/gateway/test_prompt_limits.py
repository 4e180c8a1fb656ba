"""Bounded requests at the gateway: prompt size caps checked before tokenizing, the
request id limit, request ids scoped per tenant, the priority ceiling, and a 16 MB prompt
tokenized off the event loop (case C37)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import pytest_asyncio

from gateway.generation import GatewayCore
from gateway.mesh_client import GrpcMeshClient
from gateway.prompt_limits import PromptLimits
from gateway.request import GenerationRequest, ModelInfo
from gateway.tenants import Tenant
from meshserve.errors import AlreadyExists, InvalidArgument
from meshserve.request_ids import MAX_REQUEST_ID_LEN
from tests.support.redis_server import free_port

MODEL = ModelInfo("test-model", max_model_len=2048, vocab_size=49152, revision="r1")
ACME, GLOBEX = Tenant("acme"), Tenant("globex", default_priority=9, max_priority=2)


@pytest_asyncio.fixture
async def core(tokenizer):
    c = GatewayCore(tokenizer, MODEL, GrpcMeshClient(f"127.0.0.1:{free_port()}"),
                    prompt_limits=PromptLimits(max_prompt_bytes=1000, max_messages=4))
    yield c
    await c.close()


@pytest.mark.parametrize("request_, message", [
    (GenerationRequest(prompt="x" * 1001), "prompt is over the limit of 1000 bytes (UTF-8)"),
    (GenerationRequest(prompt="é" * 501), "prompt is over the limit of 1000 bytes (UTF-8)"),  # 1002 bytes
    (GenerationRequest(chat=(("user", "a" * 600), ("assistant", "b" * 401))),
     "chat.messages is over the limit of 1000 bytes (UTF-8)"),
    (GenerationRequest(chat=tuple(("user", "hi") for _ in range(100_000))),
     "chat.messages has 100000 messages; the limit is 4"),
    (GenerationRequest(prompt_token_ids=tuple(range(2048))),
     "prompt has 2048 tokens; max_model_len is 2048 (prompt + at least 1 output token)"),
    (GenerationRequest(prompt="Hi", request_id="r" * (MAX_REQUEST_ID_LEN + 1)),
     f"request_id has {MAX_REQUEST_ID_LEN + 1} characters; the limit is {MAX_REQUEST_ID_LEN}"),
    (GenerationRequest(prompt="ab\ud800"), "prompt is not valid Unicode: a lone surrogate at character 2"),
    (GenerationRequest(chat=(("user", "é\udfff"),)),
     "chat.messages[0].content is not valid Unicode: a lone surrogate at character 1"),
])
async def test_oversized_requests_are_refused_with_the_field_and_its_cap(core, request_, message):
    """C37: 100,000 messages and oversized prompts: INVALID_ARGUMENT naming the field and
    its cap, checked before tokenization (``RequestPreparer._check_before_tokenizing``)."""
    with pytest.raises(InvalidArgument) as info:
        await core.prepare_async(request_, ACME)
    assert str(info.value) == message


async def test_prepare_refuses_at_the_cap_and_accepts_just_under_it(core):
    with pytest.raises(InvalidArgument, match="over the limit of 1000 bytes"):
        await core.prepare_async(GenerationRequest(prompt="a " * 500 + "b"), ACME)
    p = await core.prepare_async(GenerationRequest(prompt="a " * 500), ACME)
    assert len(p.prompt_ids) > 0
    core.end(p)


async def test_request_ids_are_scoped_per_tenant(core):
    a = core.prepare(GenerationRequest(prompt="Hi", request_id="same"), ACME)
    g = core.prepare(GenerationRequest(prompt="Hi", request_id="same"), GLOBEX)  # no collision across tenants
    with pytest.raises(AlreadyExists):
        core.prepare(GenerationRequest(prompt="Hi", request_id="same"), ACME)
    core.end(a)
    core.end(g)


async def test_priority_above_the_tenant_ceiling_is_clamped(core):
    p = core.prepare(GenerationRequest(prompt="Hi", priority=2**31 - 1), GLOBEX)
    q = core.prepare(GenerationRequest(prompt="Hi"), GLOBEX)  # default 9, ceiling 2
    r = core.prepare(GenerationRequest(prompt="Hi", priority=1), GLOBEX)
    assert (p.priority, q.priority, r.priority) == (2, 2, 1)
    for x in (p, q, r):
        core.end(x)


class LoopLagProbe:
    """The event loop's lag: a callback due every ``interval_s`` records how late it ran
    (seconds); ``max_lag_s`` is the longest the loop was unable to run anything else."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.max_lag_s = 0.0
        self.num_ticks = 0
        self._handle = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval_s

        def tick(due=due):
            now = loop.time()
            self.max_lag_s = max(self.max_lag_s, now - due)
            self.num_ticks += 1
            self._handle = loop.call_at(now + self.interval_s, tick, now + self.interval_s)

        self._handle = loop.call_at(due, tick)

    def stop(self) -> None:
        self._handle.cancel()


def record_builds(core: GatewayCore, probe: LoopLagProbe) -> list[tuple[int, int]]:
    """Wraps ``core.prompt_memo.build`` (the tokenization and chat templating): the list
    gets, for each build, the id of the thread it ran on and the probe's ticks while it ran."""
    builds = []
    build = core.prompt_memo.build

    def recording(request):
        ticks = probe.num_ticks
        try:
            return build(request)
        finally:
            builds.append((threading.get_ident(), probe.num_ticks - ticks))

    core.prompt_memo.build = recording
    return builds


async def test_a_16_mb_prompt_is_refused_by_the_byte_cap_before_it_is_tokenized(tokenizer):
    """C37: a 16 MB prompt under the default caps: INVALID_ARGUMENT naming the cap, checked
    on the event loop before anything is tokenized (a check in microseconds: nothing
    stalls the loop). The loop's longest stall is printed, not bounded: a loaded host
    that deschedules the test stalls it however fast the check is."""
    core = GatewayCore(tokenizer, MODEL, GrpcMeshClient(f"127.0.0.1:{free_port()}"))
    probe = LoopLagProbe()
    builds = record_builds(core, probe)
    probe.start()
    try:
        with pytest.raises(InvalidArgument, match=f"prompt is over the limit of {256 << 10} bytes"):
            await core.prepare_async(GenerationRequest(prompt="x" * (16 << 20)), ACME)
    finally:
        probe.stop()
        await core.close()
    print(f"16 MB prompt refused; event-loop max lag {probe.max_lag_s * 1000:.1f} ms")
    assert builds == []  # refused before the tokenizer saw it


async def test_a_prompt_at_the_byte_cap_is_tokenized_off_the_event_loop(tokenizer):
    """C37: the largest prompt the default cap lets through (256 KiB) is tokenized in a
    worker thread, and the event loop runs meanwhile (an event-loop-lag probe's callbacks
    run while it is tokenized), so another caller's health check is answered meanwhile
    (tokenized on the loop, the loop would stall for the whole tokenization, about half a
    second). The loop's longest stall is printed, not bounded: a loaded host that
    deschedules the test stalls it whatever runs where."""
    core = GatewayCore(tokenizer, MODEL, GrpcMeshClient(f"127.0.0.1:{free_port()}"))
    sentence = "the quick brown fox jumps over the lazy dog. "
    prompt = sentence * ((256 << 10) // len(sentence))
    probe = LoopLagProbe()
    builds = record_builds(core, probe)
    probe.start()
    started = time.monotonic()
    try:
        with pytest.raises(InvalidArgument, match="max_model_len is 2048"):  # tokenized, then too long
            await core.prepare_async(GenerationRequest(prompt=prompt), ACME)
    finally:
        probe.stop()
        await core.close()
    print(f"256 KiB prompt: tokenized in {time.monotonic() - started:.2f} s; event-loop max lag "
          f"{probe.max_lag_s * 1000:.1f} ms over {probe.num_ticks} ticks")
    ((thread, ticks),) = builds
    assert thread != threading.get_ident()  # not the event loop's thread
    assert ticks > 0  # the loop ran its callbacks while the prompt was tokenized
