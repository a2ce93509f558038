"""The import graph of Sluice's packages has no cycle, and the house's layering rules hold.

Every module of ``gateway``, ``predictor``, ``simulator``, ``replay`` and ``planner`` is parsed
with ``ast``; nothing is imported. An edge A -> B means A's source imports B, wherever the
statement stands: at module level, under ``if TYPE_CHECKING:``, or inside a function.

Both kinds of guarded import are INCLUDED on purpose. Neither creates an import-time cycle, and
that is why they hide one: the cycles this test was written for (plugins reading their app keys
back from ``gateway.app``, ``gateway.tenants.keys_file`` borrowing ``gateway.config.load``'s loader,
``simulator.native`` and ``simulator.server``) all sat behind a function-level import, and a
``TYPE_CHECKING`` import is still a dependency a reader must follow. The house wants each module
to sit above what it uses, so a cycle through either is a cycle. A late import with no cycle
(``gateway.cli`` loading ``gateway.serve`` only for ``serve``) is fine.

Relative imports are resolved against the importing module's package. ``from pkg import name``
is an edge to ``pkg.name`` when that is one of the parsed modules (a submodule), else to ``pkg``.
An edge goes to the module named, not to its parent packages: a package's ``__init__`` that
re-exports its submodules is not a cycle with them.

Layering asserted here: ``predictor`` imports none of ``gateway``, ``simulator``, ``aiohttp``,
``redis``, ``prometheus_client``; ``simulator`` imports none of ``predictor``, ``gateway``,
``replay``; ``gateway`` imports neither ``simulator`` nor ``replay`` nor ``planner`` (it starts
emulators and the planner as processes, ``python -m simulator``, ``python -m planner``).
``replay`` may import all three: it is the second adapter over the gateway's code, driving the
emulator's engine. ``planner`` (``sluice plan``) sits on top of ``replay``; nothing of Sluice's
imports it.
"""

from __future__ import annotations

import ast
import functools
import graphlib
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "predictor", "simulator", "replay", "planner")

# package -> top-level names it must never import (the house's layering rules).
FORBIDDEN: dict[str, frozenset[str]] = {
    "predictor": frozenset({"gateway", "simulator", "aiohttp", "redis", "prometheus_client", "planner"}),
    "simulator": frozenset({"predictor", "gateway", "replay", "planner"}),
    "gateway": frozenset({"simulator", "replay", "planner"}),
    "replay": frozenset({"planner"}),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    """Module name -> source file, for every module of PACKAGES."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imported_modules(module: str, is_package: bool, tree: ast.Module, known: set[str]) -> set[str]:
    """Fully qualified names of the modules this module's source imports, anywhere in it.

    ``from pkg import name`` yields ``pkg.name`` when that is a module in ``known``, else ``pkg``.
    """
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            # A relative import is relative to the module's package: itself if a package, else its parent.
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, node.module] if node.module else anchor)
        else:
            base = node.module or ""
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            imported.add(submodule if submodule in known else base)
    return imported


@functools.cache
def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> modules of PACKAGES it imports, module -> top-level names of all it imports)."""
    sources = _sources()
    known = set(sources)
    edges: dict[str, set[str]] = {}
    tops: dict[str, set[str]] = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _imported_modules(module, path.name == "__init__.py", tree, known)
        edges[module] = {name for name in imported if name in known and name != module}
        tops[module] = {name.split(".")[0] for name in imported}
    return edges, tops


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, each as [a, b, ..., a] where each module imports the next; [] when none.

    graphlib reports one cycle per sort, so each one found has an edge cut and the sort is
    retried until the graph sorts: every group of modules importing each other shows at least
    one of its cycles.
    """
    # TopologicalSorter takes node -> predecessors: a module's predecessors are what it imports.
    remaining = {module: set(targets) for module, targets in edges.items()}
    found: list[list[str]] = []
    while True:
        try:
            tuple(graphlib.TopologicalSorter(remaining).static_order())
        except graphlib.CycleError as error:
            # args[1] is [x, y, ..., x] with each node a predecessor of the next: y imports x.
            cycle: list[str] = error.args[1]
            remaining[cycle[1]].discard(cycle[0])
            found.append(cycle[::-1])
            continue
        return found


def _parse(source: str, module: str, known: set[str], is_package: bool = False) -> set[str]:
    return _imported_modules(module, is_package, ast.parse(source), known)


def test_relative_and_submodule_imports_resolve() -> None:
    known = {"pkg", "pkg.sub", "pkg.sub.leaf", "pkg.other"}
    source = "from .. import other\nfrom . import leaf\nfrom ..sub import thing\n"
    assert _parse(source, "pkg.sub.mod", known) == {"pkg.other", "pkg.sub.leaf", "pkg.sub"}
    assert _parse("from .sub import leaf, thing\n", "pkg.mod", known) == {"pkg.sub.leaf", "pkg.sub"}
    assert _parse("from .leaf import f\n", "pkg.sub", known, is_package=True) == {"pkg.sub.leaf"}
    # Late and TYPE_CHECKING imports are edges too.
    late = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pkg.other\n"
        "def f():\n    from pkg import sub\n"
    )
    assert _parse(late, "pkg.mod", known) == {"typing", "pkg.other", "pkg.sub"}


def test_cycles_are_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}}
    cycles = _cycles(edges)
    assert sorted(sorted(set(cycle)) for cycle in cycles) == [["a", "b", "c"], ["e", "e2"]]
    for cycle in cycles:
        assert all(after in edges[before] for before, after in itertools.pairwise(cycle))
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_packages_are_parsed() -> None:
    edges, _ = _graph()
    assert {
        "gateway.app",
        "gateway.serve",
        "gateway.cli",
        "predictor.forecast",
        "simulator.server",
        "replay.loop",
    } <= set(edges)
    assert "gateway.serve" in edges["gateway.cli"]
    assert "gateway.app" in edges["gateway.serve"]
    assert "gateway.serve" not in edges["gateway.app"]
    assert {"replay.emulated", "simulator.engine"} <= edges["replay.loop"]


def test_no_import_cycle() -> None:
    edges, _ = _graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles (each module imports the next):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package: str) -> None:
    _, tops = _graph()
    violations = {
        module: sorted(names & FORBIDDEN[package])
        for module, names in sorted(tops.items())
        if module.split(".")[0] == package and names & FORBIDDEN[package]
    }
    assert not violations, f"{package} imports what it must not: {violations}"
