"""``meshserve demo``: the local mesh answering 8 real chat prompts at once.

Starts scheduler, executor(s) and gateway as separate processes, their logs in a
new temporary directory, which is kept; once the mesh is up it prints what the
first executor's log says of the dtype and kernels it chose; it streams the 8
answers side by side in the terminal as tokens arrive, prints a summary (TTFT
p50/p99, output tokens/s) and stops every process.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from meshserve.bench.stats import percentile
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.cli.options import show_model_conversion
from meshserve.client import build_request, channel, generate
from meshserve.model_files import resolve_model
from meshserve.v1 import gateway_pb2_grpc

CHOICE_LOGGERS = ("executor.models.cpu_dtype", "executor.model_loader", "executor.attention.cpu_kernel")
"""The executor's loggers whose lines say which dtype and kernels it chose (CPU)."""

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for learning Python.",
    "What is a black hole?",
    "Name three colors of the rainbow.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot.",
]


def choice_lines(log: Path) -> list[str]:
    """The messages of an executor's log (one file, ``meshserve.log_format.LINE_FORMAT``:
    date, time, logger, level, message) from ``CHOICE_LOGGERS``, in order; none when the
    log cannot be read."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    fields = (line.split(" ", 4) for line in lines)
    return [f[4] for f in fields if len(f) == 5 and f[2] in CHOICE_LOGGERS]


def _table(texts: list[str], done: list[str]) -> Table:
    table = Table(show_header=True, header_style="bold", expand=True)
    table.add_column("prompt", ratio=1)
    table.add_column("answer (streaming)", ratio=3)
    for prompt, text, state in zip(DEMO_PROMPTS, texts, done):
        table.add_row(prompt, text.strip() + (f" [dim]\\[{state}][/dim]" if state else " ▌"))
    return table


async def _run(mesh: Mesh, max_tokens: int, console: Console) -> int:
    texts = [""] * len(DEMO_PROMPTS)
    done = [""] * len(DEMO_PROMPTS)
    async with channel(mesh.gateway_address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def one(i: int, prompt: str):
            def on_delta(text: str, _ids: list[int]) -> None:
                texts[i] += text

            out = await generate(stub, build_request(chat=[("user", prompt)], max_tokens=max_tokens, temperature=0),
                                 on_delta=on_delta)
            done[i] = f"{out.finish_reason}, {len(out.token_ids)} tokens"
            return out

        start = time.monotonic()
        with Live(_table(texts, done), console=console, refresh_per_second=8) as live:
            task = asyncio.gather(*(one(i, p) for i, p in enumerate(DEMO_PROMPTS)))
            while not task.done():
                live.update(_table(texts, done))
                await asyncio.sleep(0.125)
            live.update(_table(texts, done))
        results = await task
        wall = time.monotonic() - start
    ttfts = [r.timings["ttft_s"] for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    console.print(
        f"\n[bold]{len(results)} requests[/bold] in {wall:.2f} s: TTFT p50 {percentile(ttfts, 50):.3f} s, "
        f"p99 {percentile(ttfts, 99):.3f} s; {tokens} output tokens, {tokens / wall:.1f} output tokens/s"
    )
    return 0


def run_demo(port: int, executors: int, max_tokens: int) -> int:
    """Runs the demo; returns the process exit code. SIGTERM and SIGHUP (the terminal
    closed) stop it as Ctrl-C does: the services, in process groups of their own, get
    neither, and are stopped in order."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    console = Console(soft_wrap=True)  # piped output keeps whole lines (rich wraps at 80 columns off a terminal)
    log_dir = Path(tempfile.mkdtemp(prefix="meshserve-demo-"))
    mesh = Mesh(MeshConfig(port=port or 0, executors=executors, log_dir=log_dir, cpu_affinity=True))
    show_model_conversion()  # a first run dequantizes the bundled GGUF once, before the services start
    try:
        resolve_model(mesh.config.model)
    except FileNotFoundError as exc:  # the bundled model's package is missing
        console.print(f"error: {exc}")
        shutil.rmtree(log_dir, ignore_errors=True)  # nothing was logged there
        return 1
    if mesh.cpu_warning:
        console.print(f"warning: {mesh.cpu_warning}")
    console.print(f"Starting the mesh (scheduler, {executors} executor(s), gateway); logs in {log_dir} …",
                  soft_wrap=True)
    mesh.on_progress = lambda line: console.print(line, markup=False, highlight=False)  # a slow first start
    rc = 1
    try:
        t0 = time.monotonic()
        try:
            asyncio.run(mesh.start())
        except (OSError, RuntimeError, TimeoutError, ValueError) as exc:  # said as `up` says it: no traceback
            console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
            return 1  # after the finally: what started is stopped, and the logs are named
        console.print(f"Mesh up in {time.monotonic() - t0:.1f} s: gateway {mesh.gateway_address}, "
                      f"scheduler {mesh.scheduler_address}, executors {', '.join(mesh.executor_addresses)}")
        if mesh.cores_line():
            console.print(f"cores: {mesh.cores_line()}")
        for line in choice_lines(log_dir / f"{mesh.executor_names[0]}.log"):
            console.print(f"{mesh.executor_names[0]}: {line}", markup=False, highlight=False, soft_wrap=True)
        rc = asyncio.run(_run(mesh, max_tokens, console))
    except KeyboardInterrupt:
        rc = 130
    finally:
        try:
            if mesh.stop() and rc == 0:  # a service had to be killed: its log says why
                rc = 1
        except KeyboardInterrupt:  # a second Ctrl-C: every service was killed
            rc = 130
        console.print(f"Mesh stopped; the services' logs are in {log_dir}", soft_wrap=True)
    return rc
