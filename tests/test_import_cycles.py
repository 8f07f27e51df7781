"""Imports run one way: no module of autopar or cost_models imports, directly or through others, itself.

The import graph is read from the source with `ast` (nothing is imported, so no side effect hides or adds
an edge). Every import statement counts, wherever it stands: at the top, inside a function (a lazy import
hides a cycle, it does not remove it) and under `if TYPE_CHECKING:` (a module that names another's type
knows it). A package `__init__` that only hands names on (docstring, imports, `__all__`) is looked through:
`from pkg import name` is an edge to the submodule that defines `name`, and the `__init__`'s own imports
are not edges. Any other `__init__` is a module like the rest. Importing `a.b.c` is an edge to `a.b.c`
only, not to the packages above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autopar", "cost_models")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_pass_through(tree: ast.Module) -> bool:
    """An __init__ whose body is only a docstring, imports and `__all__`."""
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
        return False
    return True


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import statement anywhere in the tree."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(target, alias.name) for alias in node.names]
    return out


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> nx.DiGraph:
    """Modules of `packages` under `root` and who imports whom among them."""
    trees: dict[str, tuple[ast.Module, bool]] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            trees[_module_name(path, root)] = (ast.parse(path.read_text(), str(path)), path.name == "__init__.py")
    pass_through = {m for m, (tree, is_pkg) in trees.items() if is_pkg and _is_pass_through(tree)}
    # what each pass-through package hands on: name -> the module it comes from
    handed: dict[str, dict[str, str]] = {m: {} for m in pass_through}
    for m in pass_through:
        for target, name in _imports(trees[m][0], m, True):
            if name is not None:
                handed[m][name] = f"{target}.{name}" if f"{target}.{name}" in trees else target

    def resolve(target: str, name: str | None, seen: frozenset[str] = frozenset()) -> str | None:
        if name is not None and f"{target}.{name}" in trees:
            target, name = f"{target}.{name}", None
        if target not in trees:
            return None  # outside the packages: torch, the standard library, ...
        if target in pass_through and target not in seen:
            if name is None:
                return None  # `import pkg` of a pass-through package: names only
            return resolve(handed[target].get(name, target), None, seen | {target})
        return target

    graph = nx.DiGraph()
    graph.add_nodes_from(m for m in trees if m not in pass_through)
    for m, (tree, is_pkg) in trees.items():
        if m in pass_through:
            continue
        for target, name in _imports(tree, m, is_pkg):
            dst = resolve(target, name)
            if dst is not None and dst != m:
                graph.add_edge(m, dst)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """One cycle per strongly connected group of modules that import each other, shortest first."""
    found = []
    for group in nx.strongly_connected_components(graph):
        if len(group) > 1:
            sub = graph.subgraph(group)
            found.append(min(nx.simple_cycles(sub, length_bound=len(group)), key=len))
    return sorted(found, key=len)


def test_imports_are_acyclic() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (every import counts, lazy and TYPE_CHECKING ones too; pass what a module " \
        "needs, or move what both need to a lower module):\n" + "\n".join("  " + " → ".join([*c, c[0]]) for c in found)


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The reader finds a cycle closed by a function-level import and one closed by a TYPE_CHECKING import,
    and looks through a pass-through __init__."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""names"""\nfrom pkg.a import A\n__all__ = ["A"]\n')
    (pkg / "a.py").write_text("from pkg import b\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import A\n    return A\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sub import d\n")
    (pkg / "sub" / "d.py").write_text("from . import c\n")
    (pkg / "e.py").write_text("from pkg import A\n")  # through the pass-through __init__ to pkg.a: no cycle
    found = cycles(import_graph(tmp_path, ("pkg",)))
    assert sorted(sorted(c) for c in found) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
    assert ("pkg.e", "pkg.a") in import_graph(tmp_path, ("pkg",)).edges
