"""The structure the code relies on (ARCHITECTURE.md), checked from the source itself:
no import circle between files or packages, the engine never imports Ray or the serving layer,
and every public function carries type hints."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "router", "workers", "bench", "loadtest")
# Which top-level package may import which (a DAG: no circle between packages).
ALLOWED = {
    "engine": set(),
    "workers": {"engine"},
    "router": {"engine", "workers"},
    "loadtest": set(),
    "bench": {"engine", "workers", "router", "loadtest"},
}
HINTED = ("engine", "router", "workers")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


def _imported_names(tree: ast.AST) -> list[str]:
    """Every absolute import in the file, function-level ones included (a lazy import is still
    an edge); imports only for type checkers are left out."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    names = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, module -> third-party roots it imports)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name:
            if name in mods:
                return name
            name = name.rpartition(".")[0]
        return None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for name in _imported_names(ast.parse(path.read_text())):
            target = resolve(name) if name.split(".")[0] in PACKAGES else None
            if target is None:
                external[m].add(name.split(".")[0])
            elif target != m:
                edges[m].add(target)
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_files():
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_packages_import_only_downwards():
    edges, _ = _graph()
    wrong = sorted(
        {
            (m, t)
            for m, ts in edges.items()
            for t in ts
            if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]
        }
    )
    assert wrong == []


def test_engine_never_imports_ray():
    _, external = _graph()
    assert sorted(m for m, ext in external.items() if m.startswith("engine") and "ray" in ext) == []


def test_engine_never_imports_opentelemetry():
    """Request traces are the serving layer's (router/tracing.py), built from what the engine reports."""
    _, external = _graph()
    assert sorted(m for m, ext in external.items() if m.startswith("engine") and "opentelemetry" in ext) == []


def test_checker_finds_a_circle():
    """The checker itself can fail."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _unhinted(path: Path) -> list[str]:
    missing = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for n in body:
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                visit(n.body, f"{prefix}{n.name}.")
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if n.name.startswith("_") and n.name != "__init__":
                    continue
                args = n.args.posonlyargs + n.args.args + n.args.kwonlyargs
                if prefix and args and args[0].arg in ("self", "cls"):
                    args = args[1:]
                args += [a for a in (n.args.vararg, n.args.kwarg) if a is not None]
                if any(a.annotation is None for a in args) or n.returns is None:
                    missing.append(f"{path.relative_to(ROOT)}:{n.lineno} {prefix}{n.name}")

    visit(ast.parse(path.read_text()).body, "")
    return missing


@pytest.mark.parametrize("package", HINTED)
def test_public_functions_have_type_hints(package):
    missing = [m for p in sorted((ROOT / package).rglob("*.py")) for m in _unhinted(p)]
    assert missing == []
