"""The layout's boundaries, read from the source (an AST walk; nothing is imported).

Every import counts: module level, inside functions (lazy) and under
``TYPE_CHECKING``, since each is a dependency of the design even where it cannot
fail at import time.

* no import cycle among the project's modules (a registry imports its plug-ins,
  never a base module its plug-ins);
* the shared library (``meshserve/`` outside ``meshserve/cli`` and
  ``meshserve/bench``) imports no service;
* no service imports another service, nor the entry points or benchmarks;
* a test imports shared helpers from ``tests.support`` only, never another test module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "scheduler", "executor", "kvstore")
PACKAGES = ("meshserve", *SERVICES, "tests")
ENTRY_POINTS = ("meshserve.cli", "meshserve.bench")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Dotted name → file of every module of the project's packages."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name ``module`` imports, relative imports resolved; ``from a import b``
    gives ``a.b`` (a submodule, or a name of ``a``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` is, or is inside (``a.b.f`` → ``a.b``); None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Project module → the project modules it imports."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        targets = {_resolve(n, modules) for n in _imported_names(path, module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_cycle_finder_finds_a_cycle_and_ignores_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_the_project_modules():
    assert cycles(import_graph()) == []


def test_the_shared_library_imports_no_service():
    graph = import_graph()
    library = [m for m in graph if _top(m) == "meshserve" and not any(_under(m, e) for e in ENTRY_POINTS)]
    assert "meshserve.block_hash" in library and "meshserve.kvstore_client" in library
    bad = sorted((m, t) for m in library for t in graph[m] if _top(t) in SERVICES)
    assert bad == []


def test_no_service_imports_another_service_or_the_entry_points():
    graph = import_graph()
    bad = sorted((m, t) for m in graph if _top(m) in SERVICES for t in graph[m]
                 if (_top(t) in SERVICES and _top(t) != _top(m)) or any(_under(t, e) for e in ENTRY_POINTS))
    assert bad == []


def test_tests_share_helpers_through_tests_support_only():
    graph = import_graph()
    bad = sorted((m, t) for m in graph if _top(m) == "tests" for t in graph[m]
                 if _top(t) == "tests" and not _under(t, "tests.support"))
    assert bad == []


def test_the_files_the_workers_run_one_at_a_time_exist():
    """``tests/support/workers.PROCESS_FILES`` names real test files (a renamed one would
    silently run beside another process-starting file)."""
    from tests.support.workers import PROCESS_FILES

    assert sorted(p for p in PROCESS_FILES if not (ROOT / p).is_file()) == []
