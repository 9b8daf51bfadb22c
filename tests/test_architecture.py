"""The package's import graph, read from the source: no cycles (lazy imports inside functions count too; imports
only for type checking do not), and each layer imports only the ones beneath it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "distrain"


def _modules() -> dict[str, Path]:
    out = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = file
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (no import at run time)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            lines |= {n.lineno for child in node.body for n in ast.walk(child) if hasattr(n, "lineno")}
    return lines


def import_graph() -> dict[str, set[str]]:
    """module → the distrain modules it imports anywhere in its source (``from distrain import x`` names
    the module ``distrain.x`` when x is one)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {name: set() for name in modules}
    for name, file in modules.items():
        tree = ast.parse(file.read_text())
        skip = _type_checking_only(tree)
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if node.__class__ not in (ast.Import, ast.ImportFrom) or node.lineno in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [*subs, base]
            for target in targets:
                found = owner(target) if target.startswith("distrain") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _reaches(graph: dict[str, set[str]], start: str, prefix: str) -> list[str]:
    return sorted(m for m in graph[start] if m == prefix or m.startswith(prefix + "."))


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = [" → ".join(c) + f"  ({'; '.join(f'{m} imports {sorted(graph[m] & set(c))}' for m in c)})" for c in found]
    assert not found, "\n".join(detail)


def test_each_layer_imports_only_the_ones_beneath_it():
    graph = import_graph()
    planner = [m for m in graph if m.startswith("distrain.planner")]
    assert not [
        (m, t) for m in planner for t in graph[m] if t in ("distrain.trainer",) or t.startswith("distrain.training")
    ]
    assert not _reaches(graph, "distrain.runtime", "distrain.planner"), "the runtime never imports the planner"
    assert not _reaches(graph, "distrain.config", "distrain.strategies"), "config.py imports no strategy"
    strategies = [m for m in graph if m.startswith("distrain.strategies")]
    above = (
        "distrain.trainer",
        "distrain.training",
        "distrain.runtime",
        "distrain.cli",
        "distrain.jobs",
        "distrain.planner",
    )
    assert not [(m, t) for m in strategies for t in graph[m] if t.startswith(above)], (
        "strategies know nothing above them"
    )


def test_the_checker_sees_a_cycle():
    """It must be able to fail: a lazy import inside a function closes a cycle just as a top-level one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_every_package_is_found_by_the_install():
    """pyproject's ``packages.find`` takes only folders with an ``__init__.py``: a folder of modules without
    one imports from a checkout (a namespace package) but is left out of a wheel (``pip install .``)."""
    from setuptools import find_packages

    with_code = {
        ".".join(d.relative_to(PACKAGE.parent).parts)
        for d in [PACKAGE, *PACKAGE.rglob("*")]
        if d.is_dir() and any(d.glob("*.py"))
    }
    assert with_code - set(find_packages(str(PACKAGE.parent), include=["distrain*"])) == set()
