"""No import circles in the package: the graph of every `import artcloud...` / `from artcloud... import`, at
module level, inside functions and under `if TYPE_CHECKING:` alike. A function-level import only hides a
circle, and one that only type checkers follow still has two modules that each need the other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "artcloud"



def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {artcloud module it imports: the line of one such import}."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    graph: dict[str, dict[str, int]] = {name: {} for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` folders up
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                # `from artcloud import locks` imports the submodule; `from artcloud.x import name`, module x
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target not in files and "." in target:  # `import artcloud.a.b` of a name, not a module
                    target = target.rpartition(".")[0]
                if target in files and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe(graph: dict[str, dict[str, int]], component: set[str]) -> str:
    """Each import inside the circle, as `a (a.py:LINE) -> b`."""
    return "; ".join(f"{a} (line {graph[a][b]}) -> {b}" for a in sorted(component) for b in sorted(graph[a])
                     if b in component)


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "artcloud.errors" in graph["artcloud.types"]  # module level
    assert "artcloud.backends.local" in graph["artcloud"]  # under TYPE_CHECKING
    assert "artcloud.report" in graph["artcloud.model"]  # `from artcloud import report`, inside a method
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [{"a", "b", "c"}]


def test_no_import_circles_in_the_package():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles: " + " | ".join(describe(graph, c) for c in found)
