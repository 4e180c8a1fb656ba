"""Two revisions of meshserve on one machine, interleaved: did a change make it faster?

For each round and each target (``engine``, ``mesh``) it runs ``meshserve bench`` on
the same seeded workload with the BEFORE tree, then the AFTER tree, each as a fresh
process importing its own tree (``PYTHONPATH``) with the same Python environment. The
runs of one round alternate, so a phase of load on a shared machine hits both sides;
the report quotes each side's runs, their medians and the ratio after/before.

    python -m meshserve.bench.revisions --before 5399d40 --after . --rounds 5 --out-dir reports/revisions

A revision that is not a folder is checked out (detached) into a temporary git
worktree, removed at the end. Output: ``OUT_DIR/<target>-<side>-r<round>.json`` (the
bench reports) and ``OUT_DIR/summary.json`` (``{target: {"before": [tok/s...],
"after": [...], "before_median", "after_median", "ratio"}}``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

TARGETS = ("engine", "mesh")
# Small enough for a few rounds in minutes on 2 cores, large enough to batch (4 running).
BENCH_ARGS = ("--concurrency", "4", "--num-requests", "8", "--prompt-len-median", "64",
              "--output-len-median", "32", "--warmup", "1", "--dtype", "float32",
              "--kv-cache-memory", "256MiB", "--num-threads", "1", "--quiet")


@contextmanager
def checkout(revision: str):
    """The tree of ``revision``: the folder itself, or a temporary detached worktree."""
    if Path(revision).is_dir():
        yield Path(revision).resolve()
        return
    root = tempfile.mkdtemp(prefix="meshserve-rev-")
    tree = Path(root) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision], check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(root, ignore_errors=True)  # the folder holding the worktree


def run_bench(tree: Path, target: str, seed: int, report: Path) -> float:
    """One ``meshserve bench`` of ``tree``; returns its output tokens/s.

    Raises:
        subprocess.CalledProcessError: the bench failed (its log is next to ``report``).
    """
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "meshserve.cli", "bench", "--target", target, *BENCH_ARGS,
           "--seed", str(seed), "--report-json", str(report)]
    with open(report.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return float(json.loads(report.read_text())["output_tokens_per_s"])


def compare(before: Path, after: Path, rounds: int, out_dir: Path, targets=TARGETS) -> dict:
    """Interleaved runs of both trees; returns (and writes) the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {t: {"before": [], "after": []} for t in targets}
    for r in range(1, rounds + 1):
        for target in targets:
            for side, tree in (("before", before), ("after", after)):
                tok_s = run_bench(tree, target, r, out_dir / f"{target}-{side}-r{r}.json")
                runs[target][side].append(tok_s)
                print(f"{target} {side} round {r}: {tok_s:.2f} tok/s", flush=True)
    summary = {}
    for target, sides in runs.items():
        b, a = statistics.median(sides["before"]), statistics.median(sides["after"])
        summary[target] = {**sides, "before_median": b, "after_median": a, "ratio": a / b}
        print(f"{target}: before median {b:.2f}, after median {a:.2f} tok/s, after/before {a / b:.3f}x")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a git revision or a folder holding a tree")
    p.add_argument("--after", default=".", help="a git revision or a folder (default: this tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--target", action="append", choices=TARGETS, help="default: both")
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    with ExitStack() as stack:
        before = stack.enter_context(checkout(args.before))
        after = stack.enter_context(checkout(args.after))
        compare(before, after, args.rounds, args.out_dir, tuple(args.target or TARGETS))


if __name__ == "__main__":
    main()
