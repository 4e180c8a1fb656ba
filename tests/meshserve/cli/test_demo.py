"""``meshserve demo`` keeps its services' logs and, once the mesh is up, prints what
the first executor's log says of the dtype and kernels it chose. The mesh and the
answers are faked here (``Mesh``, ``_run``): what is tested is what the demo prints
and keeps."""

from __future__ import annotations

from pathlib import Path

from meshserve.cli import demo

EXECUTOR_LOG = """\
2026-12-04 14:50:03,045 meshserve.metrics INFO metrics on http://127.0.0.1:38837/metrics
2026-12-04 14:50:03,045 executor.attention.cpu_kernel INFO loading the CPU GEMM kernel from /cache/cpu_gemm-1.so
2026-12-04 14:50:03,388 executor.models.cpu_dtype INFO dtype auto on CPU → bfloat16: native bfloat16
2026-12-04 14:50:04,772 executor.model_loader INFO loaded /cache/m (LlamaForCausalLM, torch.bfloat16) max_model_len=8192
2026-12-04 14:50:04,782 executor.attention.cpu_kernel INFO loading the CPU attention kernel from /cache/cpu_attn-2.so
Traceback-like line without fields
2026-12-04 14:50:14,997 executor.engine.llm_engine INFO engine ready: smollm2-135m-instruct, 2912 blocks
"""
CHOICES = ["loading the CPU GEMM kernel from /cache/cpu_gemm-1.so", "dtype auto on CPU → bfloat16: native bfloat16",
           "loaded /cache/m (LlamaForCausalLM, torch.bfloat16) max_model_len=8192",
           "loading the CPU attention kernel from /cache/cpu_attn-2.so"]


def test_choice_lines_are_the_dtype_and_kernel_messages_in_order(tmp_path):
    log = tmp_path / "executor-0.log"
    log.write_text(EXECUTOR_LOG)
    assert demo.choice_lines(log) == CHOICES
    assert demo.choice_lines(tmp_path / "missing.log") == []


class FakeMesh:
    """A mesh that starts at once; its executor-0 log is ``EXECUTOR_LOG``."""

    def __init__(self, config):
        self.config = config
        self.cpu_warning = ""
        self.gateway_address = self.scheduler_address = "127.0.0.1:1"
        self.executor_addresses, self.executor_names = ["127.0.0.1:2"], ["executor-0"]

    async def start(self) -> None:
        (self.config.log_dir / "executor-0.log").write_text(EXECUTOR_LOG)

    def cores_line(self) -> str:
        return ""

    def stop(self) -> list[str]:
        return []


def _demo_with(monkeypatch, log_dir: Path, mesh_class, run) -> None:
    """``run_demo`` over ``mesh_class`` and ``run`` (the answers), its logs in ``log_dir``."""
    monkeypatch.setattr(demo.signal, "signal", lambda *_: None)  # this test process keeps its handlers
    monkeypatch.setattr(demo.tempfile, "mkdtemp", lambda prefix: str(log_dir.mkdir() or log_dir))
    monkeypatch.setattr(demo, "Mesh", mesh_class)
    monkeypatch.setattr(demo, "resolve_model", lambda model: None)
    monkeypatch.setattr(demo, "_run", run)


def test_a_demo_that_went_well_keeps_its_logs_and_shows_the_choices(monkeypatch, tmp_path, capsys):
    log_dir = tmp_path / "demo-logs"

    async def answered(mesh, max_tokens, console) -> int:
        return 0

    _demo_with(monkeypatch, log_dir, FakeMesh, answered)
    assert demo.run_demo(0, 1, 8) == 0
    out = capsys.readouterr().out
    shown = [line.removeprefix("executor-0: ") for line in out.splitlines() if line.startswith("executor-0: ")]
    assert shown == CHOICES
    assert out.rstrip().endswith(f"Mesh stopped; the services' logs are in {log_dir}")
    assert Path(log_dir / "executor-0.log").read_text() == EXECUTOR_LOG


class FailingMesh(FakeMesh):
    """A mesh whose start fails as ``Mesh.start`` does when a service exits during start-up."""

    stopped = 0

    async def start(self) -> None:
        (self.config.log_dir / "executor-0.log").write_text("[bold]boom[/bold]\n")
        raise RuntimeError(f"executor-0 exited with code 1 during start-up; {self.config.log_dir}/executor-0.log "
                           "ends:\n[bold]boom[/bold]")

    def stop(self) -> list[str]:
        FailingMesh.stopped += 1
        return []


def test_a_mesh_that_fails_to_start_is_an_error_line_not_a_traceback(monkeypatch, tmp_path, capsys):
    """As ``up`` reports it: the error (its log's tail as written, no markup), exit code 1,
    the services stopped and the logs kept."""
    log_dir = tmp_path / "demo-logs"
    monkeypatch.setattr(FailingMesh, "stopped", 0)

    async def never(mesh, max_tokens, console) -> int:
        raise AssertionError("no answers without a mesh")

    _demo_with(monkeypatch, log_dir, FailingMesh, never)
    assert demo.run_demo(0, 1, 8) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == [f"error: executor-0 exited with code 1 during start-up; {log_dir}/executor-0.log "
                                    "ends:", "[bold]boom[/bold]",
                                    f"Mesh stopped; the services' logs are in {log_dir}"]
    assert FailingMesh.stopped == 1 and (log_dir / "executor-0.log").read_text() == "[bold]boom[/bold]\n"


class SlowMesh(FakeMesh):
    """A mesh whose start reports a service it still waits for, as ``Mesh._wait`` does."""

    async def start(self) -> None:
        self.on_progress(f"still waiting for executor-0 to serve (30 s; its log: {self.config.log_dir}/[x].log)")
        await super().start()


def test_a_slow_start_says_what_it_waits_for(monkeypatch, tmp_path, capsys):
    """Each progress line of the start is printed as given (no markup), between the
    starting line and the mesh being up."""
    log_dir = tmp_path / "demo-logs"

    async def answered(mesh, max_tokens, console) -> int:
        return 0

    _demo_with(monkeypatch, log_dir, SlowMesh, answered)
    assert demo.run_demo(0, 1, 8) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Starting the mesh") and lines[2].startswith("Mesh up in ")
    assert lines[1] == f"still waiting for executor-0 to serve (30 s; its log: {log_dir}/[x].log)"
