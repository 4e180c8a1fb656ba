"""Case C35's static check: no service turns bytes into code or objects by pickle,
marshal, eval or exec (what a peer sends is parsed as protobuf, JSON or raw KV bytes)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "scheduler", "executor", "kvstore", "meshserve")
FORBIDDEN_MODULES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle"}
FORBIDDEN_BUILTINS = {"eval", "exec"}
# Where a pickle is read from no peer: the step pipe of a parallel executor is the stdin
# of the rank processes rank 0 itself started (a pipe, no socket; one executor, one trust domain).
ALLOWED = {"executor/worker/distributed.py:23 pickle"}


def findings(source: str, path: str) -> list[str]:
    """``path:line what`` for each import of a forbidden module, call of eval/exec
    or ``torch.load`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_BUILTINS:
            names = [node.func.id]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            names = ["torch.load"]
        else:
            continue
        found += [f"{path}:{node.lineno} {n}" for n in names if n in FORBIDDEN_MODULES | FORBIDDEN_BUILTINS
                  or n == "torch.load"]
    return found


def test_the_check_finds_what_it_looks_for():
    src = "import pickle\nfrom marshal import loads\neval('1')\nmodel.eval()\nimport torch\ntorch.load(f)\n"
    assert findings(src, "x.py") == ["x.py:1 pickle", "x.py:2 marshal", "x.py:3 eval", "x.py:6 torch.load"]


def test_no_service_deserializes_code_from_bytes():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += findings(path.read_text(), str(path.relative_to(ROOT)))
    assert [f for f in found if f not in ALLOWED] == []
