"""``meshserve generate --async`` against the shared mesh's own gateway (TLS: the command
trusts the test CA with ``--tls-ca``). What it prints is the model's own greedy answer
(a ``Generate`` of the same request): for one prompt the text and its
``[length; N tokens; task ID]`` line, with no header; for several prompts each answer
under its prompt; for ``--n 2`` each under its choice; with ``--json`` the result
object with its task id. A Ctrl-C once the tasks are
submitted and polled exits 130 and names the tasks, which go on, with the
``meshserve task`` commands that follow them; the printed ``--cancel`` command ends a
task CANCELLED and the mesh releases its blocks and lease. A Ctrl-C while a partition
keeps the gateway from answering (``FreezableProxy``) says no task id came back."""

import asyncio
import json
import os
import re
import shlex
import signal
import sys

import pytest

from meshserve import trace_attributes as ta
from meshserve.client import build_request, generate, get_task
from meshserve.telemetry import memory_exporter
from meshserve.v1 import gateway_pb2
from tests.support.mesh_harness import StepGate, wait_for_condition
from tests.support.net_fault import FreezableProxy
from tests.support.tls import cert_dir

pytestmark = pytest.mark.model

ENV = {k: v for k, v in os.environ.items() if k != "MESHSERVE_API_KEY"}
CA = str(cert_dir() / "ca.pem")
GREEDY = ("--temperature", "0", "--ignore-eos")
LONG = ("--max-tokens", "1000", *GREEDY)  # far more than a test lets it run: it is cancelled


async def _cli(*args: str) -> asyncio.subprocess.Process:
    """Starts ``meshserve ARGS`` (``python -m meshserve.cli``)."""
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "meshserve.cli", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=ENV)


def _addr(mesh) -> tuple[str, ...]:
    return ("--addr", mesh.gateway.address, "--tls-ca", CA)


async def _generate(mesh, *args: str) -> tuple[int, str, str]:
    """``meshserve generate --async`` on the mesh's gateway: exit code, stdout, stderr."""
    proc = await _cli("generate", "--async", *_addr(mesh), *args)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, out.decode(), err.decode()


async def _reference(mesh, prompt: str, max_tokens: int):
    """The model's answer to ``prompt`` over Generate: greedy, ``max_tokens`` tokens."""
    ref = await generate(mesh.stub, build_request(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert (ref.finish_reason, len(ref.token_ids)) == ("length", max_tokens)
    return ref


def _submitted(err: str) -> list[str]:
    """The task ids of stderr's ``task ID submitted`` lines, in their order."""
    return re.findall(r"^task (task-\w+) submitted$", err, re.MULTILINE)


async def test_one_prompt_prints_the_models_answer_and_its_line_with_no_header(mesh):
    ref = await _reference(mesh, "The capital of Italy is", 5)
    code, out, err = await _generate(mesh, "--prompt", "The capital of Italy is", "--max-tokens", "5", *GREEDY)
    (task_id,) = _submitted(err)
    assert (code, out, err) == (0, f"{ref.text}\n[length; 5 tokens; task {task_id}]\n", f"task {task_id} submitted\n")


async def test_several_prompts_print_each_answer_under_its_prompt(mesh):
    prompts = ["Water boils at", "The largest planet is"]
    refs = [await _reference(mesh, p, 4) for p in prompts]
    code, out, err = await _generate(mesh, "--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "4",
                                     *GREEDY)
    ids = re.findall(r"; task (task-\w+)\]$", out, re.MULTILINE)  # in the prompts' order
    assert code == 0 and len(set(ids)) == 2 and sorted(_submitted(err)) == sorted(ids)
    assert err == "".join(f"task {i} submitted\n" for i in _submitted(err))
    assert out == "".join(f"### {p}\n{r.text}\n[length; 4 tokens; task {i}]\n\n" for p, r, i in zip(prompts, refs, ids))
    for task_id, ref in zip(ids, refs):  # each id is its own prompt's task
        assert list((await get_task(mesh.stub, task_id)).choices[0].token_ids) == ref.token_ids


async def test_two_greedy_choices_print_each_under_its_choice(mesh):
    ref = await _reference(mesh, "Roses are red,", 4)
    code, out, err = await _generate(mesh, "--prompt", "Roses are red,", "--n", "2", "--max-tokens", "4", *GREEDY)
    (task_id,) = _submitted(err)
    assert (code, err) == (0, f"task {task_id} submitted\n")
    assert out == "".join(f"### [choice {i}]\n{ref.text}\n[length; 4 tokens; task {task_id}]\n\n" for i in (0, 1))


async def test_json_prints_the_task_result_and_its_id(mesh):
    ref = await _reference(mesh, "The capital of France is", 6)
    code, out, err = await _generate(mesh, "--json", "--prompt", "The capital of France is", "--max-tokens", "6",
                                     *GREEDY)
    (task_id,) = _submitted(err)
    assert (code, err) == (0, f"task {task_id} submitted\n")
    (line,) = out.splitlines()
    got = json.loads(line)
    assert (got["token_ids"], got["text"], got["finish_reason"], got["cached"], got["task_id"]) == (
        ref.token_ids, ref.text, "length", False, task_id)
    assert (got["usage"]["completion_tokens"], got["executor_id"]) == (6, "executor-0")
    status = await get_task(mesh.stub, task_id)
    assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED and list(status.choices[0].token_ids) == ref.token_ids


def _polled(task_ids: list[str]) -> bool:
    """The gateway has answered a GetTask of each task (its ``gateway.get_task`` span)."""
    polled = {s.attributes.get(ta.TASK_ID) for s in memory_exporter().get_finished_spans()
              if s.name == ta.SPAN_GET_TASK}
    return set(task_ids) <= polled


async def _interrupt_while_polling(mesh, proc: asyncio.subprocess.Process, gate: StepGate,
                                   tasks: int) -> tuple[list[str], str, str]:
    """Reads the command's ``tasks`` submitted lines; once the gateway has answered its
    polls of each and the engine runs them all, holds the engine (the tasks cannot
    finish meanwhile) and sends SIGINT. Returns the ids, stdout and the rest of stderr."""
    engine = mesh.engines[0]
    async with asyncio.timeout(300):
        ids = _submitted("".join([(await proc.stderr.readline()).decode() for _ in range(tasks)]))
        assert len(ids) == tasks
        await wait_for_condition(lambda: _polled(ids) and engine.stats().num_running == tasks,
                                 what="the command polling its running tasks")
        await gate.hold(engine.num_steps)
        proc.send_signal(signal.SIGINT)
        out, err = await proc.communicate()
    return ids, out.decode(), err.decode()


async def _run_printed(line: str, *extra: str) -> tuple[int, dict]:
    """Runs a printed ``  meshserve task ...`` line (plus ``extra`` flags): its exit code
    and the task status it prints (JSON)."""
    argv = shlex.split(line)
    assert argv[:2] == ["meshserve", "task"], line
    proc = await _cli(*argv[1:], *extra)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert err == b""
    return proc.returncode, json.loads(out)


async def test_request_id_names_the_request_and_takes_one_prompt(mesh):
    code, out, err = await _generate(mesh, "--prompt", "Water boils at", "--max-tokens", "2", "--request-id",
                                     "cli-named-request", "--json", *GREEDY)
    (task_id,) = _submitted(err)
    assert code == 0 and json.loads(out)["task_id"] == task_id
    status = await get_task(mesh.stub, task_id)
    assert [c.result.request_id for c in status.choices] == ["cli-named-request"]
    code, out, err = await _generate(mesh, "--prompt", "a", "--prompt", "b", "--request-id", "one-id")
    assert (code, out) == (2, "")
    message = " ".join(err.replace("│", " ").split())  # as rich's usage box wraps it
    assert "one id names one request: give --request-id with one --prompt only" in message


async def _state(mesh, task_id: str) -> int:
    return (await get_task(mesh.stub, task_id)).state


async def test_ctrl_c_while_waiting_names_the_task_and_its_printed_cancel_command_cancels_it(mesh):
    engine = mesh.engines[0]
    aborted = engine.stats().num_aborted
    with StepGate(engine) as gate:
        proc = await _cli("generate", "--async", *_addr(mesh), "--prompt", "Tell me a very long story.", *LONG)
        (task_id,), out, err = await _interrupt_while_polling(mesh, proc, gate, 1)
        follow = shlex.join(_addr(mesh))
        assert (proc.returncode, out) == (130, "")
        assert err == (f"interrupted: task {task_id} goes on without this command; fetch or cancel it with:\n"
                       f"  meshserve task {task_id} {follow} --wait\n"
                       f"  meshserve task {task_id} {follow} --cancel\n")
        assert await _state(mesh, task_id) == gateway_pb2.TASK_STATE_RUNNING  # it went on
        code, status = await _run_printed(err.splitlines()[2])
        assert (code, status["state"]) == (0, "TASK_STATE_CANCELLED")
    await mesh.wait_released()  # every block back and the lease released
    assert engine.stats().num_aborted == aborted + 1
    assert await _state(mesh, task_id) == gateway_pb2.TASK_STATE_CANCELLED


async def test_ctrl_c_with_two_tasks_names_each_and_the_api_key_their_commands_need(mesh):
    engine = mesh.engines[0]
    aborted = engine.stats().num_aborted
    with StepGate(engine) as gate:
        proc = await _cli("generate", "--async", *_addr(mesh), "--prompt", "Write a long poem.",
                          "--prompt", "Write a long letter.", *LONG, "--api-key", "k1")
        ids, out, err = await _interrupt_while_polling(mesh, proc, gate, 2)
        follow = shlex.join(_addr(mesh))
        assert (proc.returncode, out, len(set(ids))) == (130, "", 2)
        assert err == (f"interrupted: tasks {ids[0]}, {ids[1]} go on without this command; fetch or cancel them "
                       "with:\n"
                       f"  meshserve task {ids[0]} {follow} --wait\n  meshserve task {ids[0]} {follow} --cancel\n"
                       f"  meshserve task {ids[1]} {follow} --wait\n  meshserve task {ids[1]} {follow} --cancel\n"
                       "  (each with the --api-key you gave)\n")
        lines = err.splitlines()
        for task_id, line in zip(ids, (lines[2], lines[4])):
            assert await _state(mesh, task_id) == gateway_pb2.TASK_STATE_RUNNING
            code, status = await _run_printed(line, "--api-key", "k1")
            assert (code, status["state"]) == (0, "TASK_STATE_CANCELLED")
    await mesh.wait_released()
    assert engine.stats().num_aborted == aborted + 2
    assert [await _state(mesh, i) for i in ids] == [gateway_pb2.TASK_STATE_CANCELLED] * 2


async def test_ctrl_c_while_a_partition_keeps_the_gateway_silent_says_no_task_id_came_back(mesh):
    """The command reaches the gateway through a frozen proxy: its connection is open, and
    nothing it sends is answered; a Ctrl-C then has no task id to name."""
    proxy = FreezableProxy(mesh.gateway.address)
    await proxy.start()
    proxy.freeze()
    try:
        proc = await _cli("generate", "--async", "--addr", proxy.address, "--tls-ca", CA, "--prompt", "Hello",
                          "--max-tokens", "2")
        async with asyncio.timeout(300):
            await wait_for_condition(lambda: proxy.connections == 1, what="the command connected to the proxy")
            proc.send_signal(signal.SIGINT)
            out, err = await proc.communicate()
    finally:
        await proxy.stop()
    assert (proc.returncode, out.decode(), err.decode()) == (
        130, "", "interrupted before the gateway acknowledged a task (a submit in flight may still have been "
                 "accepted); no task id to follow\n")
    await mesh.wait_released()


async def test_a_failed_prompt_among_several_is_named_in_its_error_line(mesh):
    """Found by a new user: with several prompts a refused one printed a bare
    ``error: CODE: …`` line that did not say which prompt it was."""
    long_prompt = "word " * 2000  # past the engine's max_model_len (1024): INVALID_ARGUMENT at submit
    ref = await _reference(mesh, "The capital of Spain is", 4)
    code, out, err = await _generate(mesh, "--prompt", "The capital of Spain is", "--prompt", long_prompt,
                                     "--max-tokens", "4", *GREEDY)
    (task_id,) = _submitted(err)
    assert (code, out) == (1, f"### The capital of Spain is\n{ref.text}\n[length; 4 tokens; task {task_id}]\n\n")
    (error_line,) = [line for line in err.splitlines() if line.startswith("error")]
    assert error_line.startswith(f"error (prompt {long_prompt[:60] + '…'!r}): INVALID_ARGUMENT: prompt has ")


async def test_cancelling_a_task_that_already_finished_says_nothing_was_cancelled(mesh):
    code, _, err = await _generate(mesh, "--prompt", "The capital of Spain is", "--max-tokens", "2", *GREEDY)
    (task_id,) = _submitted(err)
    assert code == 0
    proc = await _cli("task", task_id, "--cancel", *_addr(mesh))
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert (proc.returncode, json.loads(out)["state"], err.decode()) == (
        0, "TASK_STATE_SUCCEEDED", f"task {task_id} had already finished (SUCCEEDED): nothing cancelled\n")
