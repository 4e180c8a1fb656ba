"""``meshserve generate --async`` against a stand-in gateway: what it prints for one
prompt and for several, and what a Ctrl-C while it waits tells the user (the tasks
go on; the commands that fetch or cancel them), with exit code 130."""

import asyncio
import os
import signal
import sys

from meshserve.cli.client import interrupted_note
from tests.support.mesh_harness import wait_for_condition
from tests.support.task_gateway import task_gateway

ENV = {k: v for k, v in os.environ.items() if k != "MESHSERVE_API_KEY"}


async def _start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "meshserve.cli", "generate", "--async", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=ENV)


async def _generate(*args: str) -> tuple[int, str, str]:
    proc = await _start(*args)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def test_one_prompt_prints_the_answer_and_its_line_with_no_header():
    async with task_gateway() as gw:
        code, out, err = await _generate("--addr", gw.address, "--prompt", "Hi")
    assert (code, out, err) == (0, "answer 0 to Hi\n[length; 3 tokens; task task-Hi]\n", "task task-Hi submitted\n")


async def test_several_prompts_are_headed_by_their_prompt():
    async with task_gateway() as gw:
        code, out, err = await _generate("--addr", gw.address, "--prompt", "Hi", "--prompt", "Yo")
    assert code == 0
    assert out == ("### Hi\nanswer 0 to Hi\n[length; 3 tokens; task task-Hi]\n\n"
                   "### Yo\nanswer 0 to Yo\n[length; 3 tokens; task task-Yo]\n\n")
    assert sorted(err.splitlines()) == ["task task-Hi submitted", "task task-Yo submitted"]


async def test_several_choices_of_one_prompt_are_headed_by_their_choice():
    async with task_gateway() as gw:
        code, out, _ = await _generate("--addr", gw.address, "--prompt", "Hi", "--n", "2")
    assert code == 0
    assert out == ("### [choice 0]\nanswer 0 to Hi\n[length; 3 tokens; task task-Hi]\n\n"
                   "### [choice 1]\nanswer 1 to Hi\n[length; 3 tokens; task task-Hi]\n\n")


async def _interrupt(proc: asyncio.subprocess.Process, gw, tasks: int) -> tuple[list[str], str, str]:
    """Waits for ``tasks`` ``submitted`` lines and a poll, sends SIGINT; returns the
    submitted lines, then the rest of stdout and stderr."""
    async with asyncio.timeout(120):
        submitted = [(await proc.stderr.readline()).decode() for _ in range(tasks)]
        await wait_for_condition(lambda: gw.polls >= tasks, what="the command polls its tasks")
        proc.send_signal(signal.SIGINT)
        out, err = await proc.communicate()
    return submitted, out.decode(), err.decode()


async def test_ctrl_c_while_waiting_names_the_task_and_how_to_follow_it():
    async with task_gateway(done=False) as gw:
        proc = await _start("--addr", gw.address, "--prompt", "Hi")
        submitted, out, err = await _interrupt(proc, gw, 1)
    assert proc.returncode == 130
    assert submitted == ["task task-Hi submitted\n"] and out == ""
    assert err == ("interrupted: task task-Hi goes on without this command; fetch or cancel it with:\n"
                   f"  meshserve task task-Hi --addr {gw.address} --wait\n"
                   f"  meshserve task task-Hi --addr {gw.address} --cancel\n")


async def test_ctrl_c_with_several_tasks_names_each_and_the_api_key_they_need():
    async with task_gateway(done=False) as gw:
        proc = await _start("--addr", gw.address, "--prompt", "Hi", "--prompt", "Yo", "--api-key", "k1",
                            "--insecure")
        submitted, out, err = await _interrupt(proc, gw, 2)
    ids = [line.split()[1] for line in submitted]
    assert proc.returncode == 130 and sorted(ids) == ["task-Hi", "task-Yo"] and out == ""
    follow = f"--addr {gw.address} --insecure"
    assert err == (f"interrupted: tasks {ids[0]}, {ids[1]} go on without this command; fetch or cancel them with:\n"
                   f"  meshserve task {ids[0]} {follow} --wait\n  meshserve task {ids[0]} {follow} --cancel\n"
                   f"  meshserve task {ids[1]} {follow} --wait\n  meshserve task {ids[1]} {follow} --cancel\n"
                   "  (each with the --api-key you gave)\n")
    assert [r.prompt for r in gw.requests] == [i.removeprefix("task-") for i in ids]


def test_a_ctrl_c_before_an_id_came_back_says_so():
    assert interrupted_note([], 1, [], False) == (
        "interrupted before the gateway acknowledged a task (a submit in flight may still have been accepted); "
        "no task id to follow")
    assert interrupted_note(["task-a"], 3, [], False) == (
        "interrupted: task task-a goes on without this command; fetch or cancel it with:\n"
        "  meshserve task task-a --wait\n  meshserve task task-a --cancel\n"
        "2 other prompt(s) got no task id (a submit in flight may still have been accepted)")
