"""One trace per request across gateway, scheduler, executor and kvstore, rooted at
the caller's context: the basic case on the shared mesh, and case C26."""

import asyncio
import random

import grpc
import pytest
import pytest_asyncio

from kvstore.store import KVStore
from meshserve.client import build_request, generate, get_task, submit_task
from meshserve.request_ids import scoped_request_id
from meshserve.telemetry import memory_exporter
from meshserve.v1 import gateway_pb2
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

pytestmark = pytest.mark.model

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7
REQUEST = {"scheduler.admit", "scheduler.release", "executor.execute", "executor.prefill", "executor.decode"}


def traceparent(trace_id: int, parent_span_id: int) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{trace_id:032x}-{parent_span_id:016x}-01"),)


async def spans_of(trace_id: int, names: set[str], timeout_s: float = 30.0) -> list:
    """The finished spans of ``trace_id`` once ``names`` are among them (the gateway's
    span ends after the caller has its last message)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        spans = [s for s in memory_exporter().get_finished_spans() if s.context.trace_id == trace_id]
        if names <= {s.name for s in spans} or loop.time() > deadline:
            return spans
        await asyncio.sleep(0.01)


def local_root(spans: list, parent_span_id: int):
    """The one span whose parent is not in the trace: it must be the caller's child."""
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    assert len(roots) == 1, [(r.name, r.parent) for r in roots]
    assert roots[0].parent.span_id == parent_span_id and roots[0].parent.is_remote
    return roots[0]


async def test_one_trace_across_services(mesh):
    memory_exporter().clear()
    out = await generate(mesh.stub, build_request(chat=[("user", "Hi")], max_tokens=6, temperature=0),
                         metadata=traceparent(TRACE_ID, PARENT_SPAN_ID))
    assert len(out.token_ids) >= 1
    name = f"chat {mesh.engines[0].model_id}"
    spans = await spans_of(TRACE_ID, REQUEST | {name})
    assert REQUEST | {name} <= {s.name for s in spans}
    root = local_root(spans, PARENT_SPAN_ID)
    assert root.name == name and root.kind.name == "SERVER"
    a = root.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"]) == ("chat", mesh.engines[0].model_id)
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (6, 0.0, 1.0)
    assert a["gen_ai.usage.output_tokens"] == len(out.token_ids)
    assert a["gen_ai.response.finish_reasons"] == (out.finish_reason,)
    assert a["meshserve.executor_id"] == "executor-0" and a["meshserve.tenant"] == "default"
    assert any(e.name == "first_token" for s in spans for e in s.events)


async def test_a_rejected_request_is_one_error_span(mesh):
    memory_exporter().clear()
    trace_id = TRACE_ID + 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(mesh.stub, build_request("", max_tokens=4), metadata=traceparent(trace_id, PARENT_SPAN_ID))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = await spans_of(trace_id, {f"text_completion {mesh.engines[0].model_id}"})
    assert [s.name for s in spans] == [f"text_completion {mesh.engines[0].model_id}"]  # never reached the scheduler
    assert spans[0].status.status_code.name == "ERROR" and "InvalidArgument" in spans[0].status.description
    assert [e.name for e in spans[0].events] == ["exception"]


# Case C26 ---------------------------------------------------------------------

SMALL_POOL_BLOCKS = 40          # 3 prompts of 200 tokens fit (13 blocks each), their 24 outputs do not (14 each)
LONG_PROMPT = 600        # 3 chunks of max_num_batched_tokens 256; 37 full blocks of 16
LONG_HIT = (LONG_PROMPT - 1) // 16 * 16   # 592: a full hit still recomputes the last token


@pytest_asyncio.fixture(scope="module")
async def traced_mesh(tokenizer):
    engine = make_engine(num_blocks=SMALL_POOL_BLOCKS, max_num_batched_tokens=256)
    m = await start_local_mesh([engine], tokenizer, kvstore=KVStore(memory_bytes=256 << 20),
                               kvstore_fetch_timeout_s=120)
    yield m, engine
    await m.stop()


def ids_prompt(length: int, seed: int) -> list[int]:
    return [1000 + (i * 7919 + seed * 104729) % 40000 for i in range(length)]


async def test_one_trace_across_all_services_through_hits_misses_preemption_and_tasks(traced_mesh):
    """Case C26: requests carry a W3C traceparent with their own trace id T and cover a
    prefix-cache miss with chunked prefill (3 chunks) whose blocks are published to
    the kvstore, a prefix-cache hit, KV loaded from the kvstore (local cache
    emptied), and preemption (3 concurrent requests that outgrow a 40-block pool).
    Spans are exported in memory. For each request: every span made during the
    test belongs to one of the request traces; the only local root is the gateway
    span, child of the caller's parent; every other span's parent is in the trace;
    gateway, scheduler, executor and kvstore spans are all there, with exact
    token counts; preemptions are span events, one per engine preemption.
    Async submit then poll: the task's generation (gateway, scheduler, executor
    spans) is in the submit call's trace, under the ``gateway.submit_task``
    span; every ``gateway.get_task`` poll is in its own caller's trace and
    carries one span link, to the submit span."""
    m, engine = traced_mesh
    conn = engine.kv_connector
    model = engine.model_id
    rng = random.Random(26)
    memory_exporter().clear()
    parents: dict[str, tuple[int, int]] = {}   # request id -> (trace id, caller's span id)

    async def run(request_id: str, prompt: list[int], max_tokens: int):
        parents[request_id] = (rng.getrandbits(128), rng.getrandbits(64))
        out = await generate(m.stub, build_request(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                   request_id=request_id),
                             metadata=traceparent(*parents[request_id]), timeout=600)
        assert len(out.token_ids) == max_tokens
        return out

    async def trace(request_id: str, extra: set[str]) -> dict[str, list]:
        """The request's spans by name, after the checks every request's trace passes."""
        trace_id, parent_id = parents[request_id]
        spans = await spans_of(trace_id, REQUEST | extra | {f"text_completion {model}"})
        root = local_root(spans, parent_id)
        assert root.name == f"text_completion {model}" and root.attributes["meshserve.request_id"] == request_id
        for s in spans:   # the engine's and the executor's spans name the request too
            if "meshserve.request_id" in s.attributes:
                scoped = scoped_request_id("default", request_id)  # the executor's id of the request
                assert s.attributes["meshserve.request_id"] in (request_id, f"{request_id}#0", scoped,
                                                                f"{scoped}#0"), s.name
        by_name: dict[str, list] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        assert REQUEST | extra <= set(by_name), set(by_name)
        assert {s.instrumentation_scope.name for s in spans} >= {"gateway.generation", "scheduler.server",
                                                                 "executor.request_span"}
        return by_name

    long_prompt = ids_prompt(LONG_PROMPT, 0)
    # 1. miss, chunked prefill, blocks published to the kvstore
    await run("c26-miss", long_prompt, 4)
    await asyncio.to_thread(conn.flush)
    # 2. hit in the local prefix cache
    await run("c26-hit", long_prompt, 4)
    # 3. local cache emptied: the prefix comes from the kvstore
    await m.wait_idle()
    assert engine.reset_prefix_cache()
    await run("c26-kvstore", long_prompt, 4)
    # 4. preemption
    preemptions = engine.stats().num_preemptions
    await asyncio.gather(*(run(f"c26-preempt-{i}", ids_prompt(200, 10 + i), 24) for i in range(3)))
    num_preemptions = engine.stats().num_preemptions - preemptions
    assert num_preemptions > 0
    # 5. async task: submit, then poll, each poll from its own caller trace
    submit_parent = (rng.getrandbits(128), rng.getrandbits(64))
    handle = await submit_task(m.stub, build_request(ids_prompt(40, 5), max_tokens=4, temperature=0,
                                                     ignore_eos=True, request_id="c26-task"),
                               metadata=traceparent(*submit_parent))
    polls: list[tuple[int, int]] = []
    while True:
        polls.append((rng.getrandbits(128), rng.getrandbits(64)))
        status = await get_task(m.stub, handle.task_id, metadata=traceparent(*polls[-1]))
        if status.state not in (gateway_pb2.TASK_STATE_QUEUED, gateway_pb2.TASK_STATE_RUNNING):
            break
        await asyncio.sleep(0.05)
    assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED and len(status.choices[0].token_ids) == 4
    await asyncio.to_thread(conn.flush)
    await m.wait_idle()

    kv_spans = {"executor.kvstore_fetch", "kvstore.get", "executor.kvstore_publish", "kvstore.put"}
    miss = await trace("c26-miss", kv_spans)
    assert {s.instrumentation_scope.name for v in miss.values() for s in v} >= {"kvstore.server",
                                                                              "executor.kvstore_connector"}
    execute = miss["executor.execute"][0].attributes
    assert (execute["meshserve.prefix_cache.hit_tokens"], execute["meshserve.kvstore.hit_tokens"]) == (0, 0)
    assert execute["gen_ai.usage.input_tokens"] == LONG_PROMPT and execute["gen_ai.usage.output_tokens"] == 4
    assert execute["gen_ai.response.finish_reasons"] == ("length",)
    assert execute["meshserve.executor_id"] == "executor-0" and execute["meshserve.preemptions"] == 0
    assert miss["kvstore.get"][0].attributes["meshserve.kvstore.found_blocks"] == 0
    assert sum(s.attributes["meshserve.kvstore.blocks"] for s in miss["executor.kvstore_publish"]) == LONG_PROMPT // 16
    assert sum(s.attributes["meshserve.kvstore.stored_blocks"] for s in miss["kvstore.put"]) == LONG_PROMPT // 16
    assert len(miss["kvstore.put"]) == len(miss["executor.kvstore_publish"])

    hit = await trace("c26-hit", set())
    assert set(hit) == REQUEST | {f"text_completion {model}"}   # all cached here: no fetch, nothing to publish
    execute = hit["executor.execute"][0].attributes
    assert (execute["meshserve.prefix_cache.hit_tokens"], execute["meshserve.kvstore.hit_tokens"]) == (LONG_HIT, 0)
    gateway = hit[f"text_completion {model}"][0].attributes
    assert (gateway["gen_ai.usage.cache_read.input_tokens"], gateway["gen_ai.usage.output_tokens"]) == (LONG_HIT, 4)

    fetched = await trace("c26-kvstore", {"executor.kvstore_fetch", "kvstore.get"})
    execute = fetched["executor.execute"][0].attributes
    assert (execute["meshserve.prefix_cache.hit_tokens"], execute["meshserve.kvstore.hit_tokens"]) == (0, LONG_HIT)
    assert fetched["kvstore.get"][0].attributes["meshserve.kvstore.found_blocks"] == LONG_HIT // 16
    assert fetched["kvstore.get"][0].parent.span_id == fetched["executor.kvstore_fetch"][0].context.span_id
    assert fetched["executor.kvstore_fetch"][0].parent.span_id == fetched["executor.execute"][0].context.span_id

    events = 0
    for i in range(3):
        spans = await trace(f"c26-preempt-{i}", set())
        execute = spans["executor.execute"][0]
        preempted = [e for e in execute.events if e.name == "meshserve.preempted"]
        assert execute.attributes["meshserve.preemptions"] == len(preempted)
        assert all(execute.start_time <= e.timestamp <= execute.end_time for e in preempted)
        events += len(preempted)
    assert events == num_preemptions

    task_spans = await spans_of(submit_parent[0], REQUEST | {"gateway.submit_task", f"text_completion {model}"})
    submit = local_root(task_spans, submit_parent[1])
    assert submit.name == "gateway.submit_task" and submit.attributes["meshserve.task_id"] == handle.task_id
    ids = {s.context.span_id for s in task_spans}
    assert all(s.parent.span_id in ids for s in task_spans if s is not submit)
    (run,) = [s for s in task_spans if s.name == f"text_completion {model}"]
    assert run.parent.span_id == submit.context.span_id and run.attributes["meshserve.request_id"] == "c26-task"
    assert run.attributes["gen_ai.usage.output_tokens"] == 4 and run.attributes["meshserve.task_id"] == handle.task_id
    assert REQUEST <= {s.name for s in task_spans}
    for poll_trace, poll_parent in polls:
        (poll,) = await spans_of(poll_trace, {"gateway.get_task"})
        assert poll.name == "gateway.get_task" and poll.parent.span_id == poll_parent and poll.parent.is_remote
        assert [(link.context.trace_id, link.context.span_id) for link in poll.links] == [
            (submit_parent[0], submit.context.span_id)]

    traces = {t for t, _ in parents.values()} | {submit_parent[0]} | {t for t, _ in polls}
    strays = [(s.name, s.parent) for s in memory_exporter().get_finished_spans() if s.context.trace_id not in traces]
    assert strays == []
