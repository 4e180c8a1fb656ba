"""``meshserve.cli.client.interrupted_note``, the message of a Ctrl-C during ``generate --async``, where some
prompts' submits had not come back: the case the mesh cannot be made to produce on
demand. The command itself is tested on the real mesh
(``tests/mesh/test_generate_async_cli.py``: its output, a Ctrl-C with task ids, and one
before any id came back)."""

from meshserve.cli.client import interrupted_note


def test_a_ctrl_c_when_some_prompts_got_no_task_id_names_the_tasks_and_counts_the_others():
    assert interrupted_note(["task-a"], 3, ["--addr", "10.0.0.1:9000"], False) == (
        "interrupted: task task-a goes on without this command; fetch or cancel it with:\n"
        "  meshserve task task-a --addr 10.0.0.1:9000 --wait\n  meshserve task task-a --addr 10.0.0.1:9000 --cancel\n"
        "2 other prompt(s) got no task id (a submit in flight may still have been accepted)")
