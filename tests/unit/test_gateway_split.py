"""The shape of issue 34's Gateway split, checked on the source: the
:class:`~extproc.gateway.Gateway` holds what serving one request needs and runs nothing in the
background (every loop, task and drain is :class:`~extproc.background.Background`'s), and the
server's executors take one request's :class:`~extproc.server.context.RequestContext` instead
of ``(gw, cfg, s)`` threaded one by one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from extproc.background import Background
from extproc.gateway import Gateway
from extproc.server.context import RequestContext

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "extproc"

#: Calls that start or wait on background work (a task, a timer, a sleep, a drain).
BACKGROUND_CALLS = frozenset(
    {"create_task", "ensure_future", "sleep", "wait", "wait_for", "call_later", "call_soon"}
)


def background_work(tree: ast.AST) -> list[str]:
    """Where ``tree`` starts or waits on background work: such calls and coroutine
    definitions, as ``line: name``."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef):
            found.append(f"{node.lineno}: async def {node.name}")
        elif isinstance(node, ast.Call):
            f = node.func
            name = (
                f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            )
            if name in BACKGROUND_CALLS:
                found.append(f"{node.lineno}: {name}()")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_gateway_runs_nothing_in_the_background() -> None:
    tree = ast.parse((ROOT / "gateway.py").read_text(encoding="utf-8"))
    assert background_work(tree) == [], "background work belongs in extproc/background.py"


def test_the_background_check_finds_a_task_and_a_loop() -> None:
    src = (
        "import asyncio\n"
        "class G:\n"
        "    def keep(self):\n"
        "        asyncio.get_running_loop().create_task(self._loop())\n"
        "    async def _loop(self):\n"
        "        await asyncio.sleep(1)\n"
    )
    assert background_work(ast.parse(src)) == [
        "4: create_task()",
        "5: async def _loop",
        "6: sleep()",
    ]


def test_the_gateway_composes_its_background_part() -> None:
    fields = Gateway.__dataclass_fields__
    assert fields["background"].type in ("Background", Background)
    # what runs in the background is not reachable on the Gateway itself
    for name in ("pending", "track", "drain_settlements", "keep_leases", "submit_settlement"):
        assert hasattr(Background, name) or name == "pending", name
        assert name not in fields and not hasattr(Gateway, name), name


def threaded(tree: ast.AST) -> list[str]:
    """Functions of ``tree`` that take ``gw``, ``cfg`` and ``s`` as parameters together."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            if {"gw", "cfg", "s"} <= names:
                found.append(node.name)
    return found


def test_no_server_function_threads_gw_cfg_and_s() -> None:
    offenders = {
        str(path.relative_to(ROOT)): names
        for path in sorted((ROOT / "server").glob("*.py"))
        if (names := threaded(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert offenders == {}, f"take a RequestContext instead: {offenders}"


def test_the_threading_check_sees_the_three() -> None:
    src = "def f(gw, cfg, s, a): ...\nasync def g(ctx, a): ...\ndef h(gw, *, cfg, s): ...\n"
    assert threaded(ast.parse(src)) == ["f", "h"]


def test_the_request_context_is_three_slots() -> None:
    assert RequestContext.__slots__ == ("gw", "cfg", "s")
