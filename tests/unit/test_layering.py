"""The package reads top-down: the sans-IO core imports nothing above it, and no module
imports another that (directly or not) imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "extproc"
# What the core may import from the project besides itself: leaf modules with no imports.
CORE_MAY_IMPORT = ("extproc.core", "extproc.errors", "extproc.clock")
# Third-party modules that make code not sans-IO.
IO_LIBRARIES = ("grpc", "redis", "aiohttp", "envoy", "prometheus_client", "structlog")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Modules imported anywhere in the file (function-level imports included), except under
    ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text("utf-8"))
    out: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                skip.add(id(sub))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def project_graph() -> dict[str, set[str]]:
    files = [p for p in ROOT.rglob("*.py") if "_gen" not in p.parts]
    names = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        graph[name] = {m for m in imports_of(path) if m in names and m != name}
    return graph


def test_core_imports_nothing_above_it() -> None:
    """extproc.core imports only itself and the leaf modules, and no IO library."""
    bad = []
    for path in (ROOT / "core").rglob("*.py"):
        for m in imports_of(path):
            top = m.split(".")[0]
            if m.startswith("extproc") and not m.startswith(CORE_MAY_IMPORT):
                bad.append(f"{module_name(path)} imports {m}")
            if top in IO_LIBRARIES:
                bad.append(f"{module_name(path)} imports the IO library {m}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """No module reaches itself through its imports (package __init__ re-exports included)."""
    graph = project_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    # A package importing its own submodule (``extproc.config`` → ``extproc.config.load``)
    # while the submodule imports a sibling through the package name is not a real cycle.
    real = [c for c in cycles if not all(c[0].startswith(p) or p.startswith(c[0]) for p in c)]
    assert not real, "\n".join(" -> ".join(c) for c in real)


def test_the_walker_finds_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: a file importing the server is reported."""
    f = tmp_path / "x.py"
    f.write_text("from extproc.gateway import Gateway\nimport grpc\n")
    found = imports_of(f)
    assert "extproc.gateway" in found and "grpc" in found
