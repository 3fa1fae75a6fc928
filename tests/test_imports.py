"""The package's modules import each other without cycles (also none hidden inside functions).

The graph is read from the source with ``ast``: every ``import`` statement of every module,
at any depth (function bodies included), except those under ``if TYPE_CHECKING:`` (never
executed).  ``from a.b import c`` is an edge to module ``a.b.c`` when that is a module,
else to ``a.b``.  Importing a module also runs its parent packages' ``__init__``; those
implicit edges are left out, as import linters do (a package re-exporting its modules is
not a cycle), but an explicit import of a package is an edge to its ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"specfit_hf": ROOT / "specfit_hf", "specfit_kernels": ROOT / "kernels" / "specfit_kernels"}


def _modules() -> dict[str, Path]:
    out = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import statements anywhere in ``tree`` but under ``if TYPE_CHECKING``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports(ast.Module(body=[child], type_ignores=[])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    graph.add_edge(name, target)
    return graph


def test_graph_sees_the_package():
    graph = import_graph()
    assert graph.has_edge("specfit_hf.selection.specfit", "specfit_hf.selection.search")
    assert graph.number_of_nodes() > 40


def test_no_import_cycles():
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1)
    assert cycles == [], f"import cycles: {cycles}"
