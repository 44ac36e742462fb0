"""The package's import graph: arrows point one way.

Every module under ``specheads/`` (and ``kernels/``, which ships as ``specheads.kernels``) is parsed (no import runs), and every import of the package is read, at the top
of a file or inside a function alike: a late import is still an arrow. Arrows are then drawn between the package's
parts, a subpackage (``data``, ``methods``, ...) or a top-level module (``errors``, ``engine_process``, ...):

- the stages' contracts sit below their users, so ``data`` takes nothing from ``methods``, ``models`` nothing
  from ``data``, and ``decoding`` nothing from ``export``;
- no circle among the parts, nor among the modules themselves.

``ALLOWED_CIRCLES`` would list an arrow left closing a circle, each with why: it only shrinks (a test checks
that each still exists). It is empty.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import specheads

PACKAGE = Path(specheads.__file__).parent
# kernels/ sits at the top of a clone and ships as specheads.kernels (pyproject.toml)
KERNELS = PACKAGE / "kernels" if (PACKAGE / "kernels").is_dir() else PACKAGE.parent / "kernels"

FORBIDDEN = {
    ("data", "methods"),     # FeatureSpec lives with the store (data/store.py), target_argmax with the target
    ("models", "data"),      # a prepared set is read through specheads/prepared.py
    ("decoding", "export"),  # a head's folder is read through specheads/heads.py
}
# (importing part, imported part) arrows that still close a circle, each with why; this only shrinks
ALLOWED_CIRCLES: dict[tuple[str, str], str] = {}


def _files() -> list[Path]:
    return sorted({*PACKAGE.rglob("*.py"), *KERNELS.rglob("*.py")})


def _module_name(path: Path) -> str:
    if path.is_relative_to(KERNELS):
        parts = ["specheads", "kernels", *path.relative_to(KERNELS).with_suffix("").parts]
    else:
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    parts = name.split(".")
    base = KERNELS.joinpath(*parts[2:]) if parts[:2] == ["specheads", "kernels"] else PACKAGE.parent.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The package's modules an import statement reads (``from a import b`` reads ``a.b`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "specheads"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "specheads":
        return []
    subs = [f"{source}.{a.name}" for a in node.names if _is_module(f"{source}.{a.name}")]
    return subs if len(subs) == len(node.names) else [source, *subs]


def module_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: line}} over every import of the package, at any depth of the file."""
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for path in _files():
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, path.name == "__init__.py"):
                if name != module:
                    graph[module].setdefault(name, node.lineno)
    return graph


def part(module: str) -> str:
    """``specheads.data.store`` -> ``data``; ``specheads.errors`` -> ``errors``; ``specheads`` -> ``specheads``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def part_graph() -> dict[tuple[str, str], list[str]]:
    """{(part, imported part): ["module:line -> module", ...]} between different parts."""
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, imported in module_graph().items():
        for name, line in imported.items():
            if part(module) != part(name):
                arrows[part(module), part(name)].append(f"{module}:{line} -> {name}")
    return arrows


def circles(edges) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_late_and_relative_imports():
    """The reader finds what a plain ``grep`` for the arrows would: a late import and ``from a import module``."""
    graph = module_graph()
    assert "specheads.targets.model" in graph["specheads.targets"]
    assert "specheads.data.images" in graph["specheads.data.prepare"]  # from specheads.data import images as img
    late = [m for m, imported in graph.items() if "specheads.kernels.verify_greedy" in imported]
    assert "specheads.decoding.batched_verify" in late  # imported inside a function (Triton is optional)
    assert "specheads.kernels" in graph["specheads.kernels.verify_greedy"]  # kernels/ ships as specheads.kernels


def test_forbidden_arrows_are_absent():
    arrows = part_graph()
    present = {pair: arrows[pair] for pair in sorted(FORBIDDEN) if pair in arrows}
    assert not present, f"imports against the package's layering: {present}"


def test_no_circle_among_parts():
    arrows = {pair for pair in part_graph() if pair not in ALLOWED_CIRCLES}
    assert not circles(arrows), f"circles among specheads' parts: {circles(arrows)}"


def test_no_circle_among_modules():
    edges = {(m, name) for m, imported in module_graph().items() for name in imported}
    assert not circles(edges), f"modules that import each other, directly or around a loop: {circles(edges)}"


def test_allowed_circles_only_shrink():
    """Each arrow the list allows is still there (remove it from the list once the code no longer has it)."""
    arrows = part_graph()
    assert not [pair for pair in ALLOWED_CIRCLES if pair not in arrows]
