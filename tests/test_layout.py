"""The package's layout: no import circle anywhere in draftsmith/, lazy and TYPE_CHECKING imports
included (a circle makes the order modules load in matter, and each module of it depends on all)."""

from __future__ import annotations

import ast

from draftsmith.fingerprint import PACKAGE, PACKAGE_DIR, module_name, package_modules


def _named_modules(file, module: str, known: set[str]) -> set[str]:
    """The package modules ``file`` names in any import statement, at any depth (functions,
    ``if TYPE_CHECKING:`` blocks included); a parent package counts only where it is named."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    known = set(package_modules())
    files = {module_name(f): f for f in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in f.parts}
    return {module: _named_modules(files[module], module, known) for module in known}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), or of one that imports itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert f"{PACKAGE}.extract.capture" in graph  # the graph reads the package as it stands
    assert circles(graph) == []
