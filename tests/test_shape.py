"""The shape of the package, read from its source: data flows one way (no import circles, at
module level or inside functions), nothing below the facades imports the session, one module
decides C or Python, and no stage outside the format registry tests a format by name."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FACADES = {"gputrace", "gputrace.session", "gputrace._startup", "gputrace._timer", "gputrace.cli", "gputrace.demo"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, package in ((ROOT / "gputrace", "gputrace"), (ROOT / "viewer", "gputrace.viewer")):
        for p in folder.rglob("*.py"):
            name = ".".join((package, *p.relative_to(folder).with_suffix("").parts))
            mods[name.removesuffix(".__init__")] = p
    return mods


def _nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node, less the bodies of `if TYPE_CHECKING:` (imports for type checkers only)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            todo.extend(n.orelse)
            continue
        yield n
        todo.extend(ast.iter_child_nodes(n))


def import_graph() -> dict[str, set[str]]:
    """gputrace's modules -> the gputrace modules each imports (`from gputrace import x` is an
    edge to gputrace.x where x is a module; `importlib.import_module("...")` counts too)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for n in _nodes(ast.parse(p.read_text())):
            targets: list[str] = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = package.split(".")[: len(package.split(".")) - n.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in n.names:
                    full = f"{base}.{a.name}"
                    if full != "gputrace._hot":  # the C extension: no Python source, imports nothing back
                        targets.append(full if full in mods else base)
            elif isinstance(n, ast.Call) and ast.unparse(n.func).endswith("import_module"):
                if n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                    targets = [n.args[0].value]
            for t in targets:
                found = known(t)
                if found is not None and found != m:
                    graph[m].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


def test_nothing_below_the_facades_imports_the_session() -> None:
    graph = import_graph()
    assert {m for m, targets in graph.items() if "gputrace.session" in targets} <= FACADES
    assert not [m for m, targets in graph.items() if "gputrace" in targets and m not in FACADES]
    assert "gputrace.record" not in graph["gputrace.dist"]  # dist is handed the recorder
    assert "gputrace.record" not in graph["gputrace.resolve"]  # resolve is pure
    assert graph["gputrace.state"] == set()  # the state sits below everything


def test_one_module_decides_c_or_python() -> None:
    readers = [m for m, p in _modules().items() if re.search(r"environ[^\n]*GPUTRACE_PURE_PYTHON", p.read_text())]
    assert readers == ["gputrace.native"]


def test_no_stage_tests_a_format_by_name() -> None:
    by_name = re.compile(
        r"""[=!]= *["'](chrome|json|perfetto|pftrace|protobuf)["']|["'](chrome|json|perfetto)["'] *[=!]="""
    )
    found = [
        f"{m}: {line.strip()}"
        for m, p in _modules().items()
        if m != "gputrace.trace.registry"
        for line in p.read_text().splitlines()
        if by_name.search(line)
    ]
    assert found == []
