"""The runtime dependencies in ``pyproject.toml`` are exactly what the installed packages import.

``pip install .`` (and ``make run``) installs ``project.dependencies`` only; the development
extras (pytest, ruff, mypy, the openai SDK, matplotlib, ...) come with ``make test``. So every
third-party module that ``gateway``, ``predictor`` or ``simulator`` imports (parsed with ``ast``,
wherever the statement stands: module level, ``TYPE_CHECKING`` or inside a function) must come
from a runtime dependency or from what one of them requires; every runtime dependency must be
imported by them; and no development-only distribution may be reachable from the runtime set.
Distributions are read from the installed metadata (``importlib.metadata``) of the test venv.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable, Iterator
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
#: The packages the wheel installs (``tool.setuptools.packages.find``).
RUNTIME_PACKAGES = ("gateway", "predictor", "simulator", "replay", "planner")
#: Sluice's own top-level packages, installed or not.
OWN = frozenset({*RUNTIME_PACKAGES, "bench", "tests"})
#: Third-party modules an installed package may import only inside ``try: ... except
#: ImportError``, doing without them when absent: module -> the extra that installs it.
OPTIONAL = {"matplotlib": "bench"}


@cache
def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _requirements(key: str) -> list[Requirement]:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    found = project["dependencies"] if key == "dependencies" else project["optional-dependencies"][key]
    return [Requirement(text) for text in found]


def _applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    """Whether ``requirement`` holds on this interpreter with ``extras`` asked of its parent."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in (*extras, ""))


def _closure(roots: Iterable[Requirement]) -> set[NormalizedName]:
    """The distributions ``roots`` install here, transitively (markers and extras evaluated)."""
    seen: set[tuple[NormalizedName, frozenset[str]]] = set()
    names: set[NormalizedName] = set()
    todo: list[Requirement] = [r for r in roots if _applies(r, ())]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(name)
        for text in metadata.requires(requirement.name) or []:
            child = Requirement(text)
            if _applies(child, requirement.extras):
                todo.append(child)
    return names


def _guarded(tree: ast.AST) -> set[int]:
    """The ids of the import statements inside a ``try`` whose handlers catch ``ImportError``
    (or ``ModuleNotFoundError``): imports the code does without when they fail."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = {
            name.id
            for handler in node.handlers
            if handler.type is not None
            for name in ast.walk(handler.type)
            if isinstance(name, ast.Name)
        }
        if caught & {"ImportError", "ModuleNotFoundError"}:
            found |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return found


def _imported_top_levels(package: str, *, guarded: bool = False) -> Iterator[tuple[str, Path]]:
    """(top-level module, file) for every absolute import in ``package``'s sources; with
    ``guarded``, only those inside a ``try`` that catches ``ImportError``."""
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        inside = _guarded(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or (id(node) in inside) != guarded:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name.partition(".")[0], path
            elif node.level == 0 and node.module:
                yield node.module.partition(".")[0], path


def _third_party_imports() -> dict[str, set[str]]:
    """Third-party top-level module -> the files (relative to the root) that import it, but for
    the ``OPTIONAL`` modules imported under an ``ImportError`` guard."""
    found: dict[str, set[str]] = {}
    for package in RUNTIME_PACKAGES:
        imports = [
            *_imported_top_levels(package),
            *((m, p) for m, p in _imported_top_levels(package, guarded=True) if m not in OPTIONAL),
        ]
        for module, path in imports:
            if module in sys.stdlib_module_names or module in OWN:
                continue
            found.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    return found


def test_optional_modules_are_guarded_and_come_with_their_extra() -> None:
    """An ``OPTIONAL`` module is imported only under an ``ImportError`` guard, and its extra
    installs it; at least one installed package uses one (so the exemption is not dead)."""
    unguarded = sorted(
        f"{path.relative_to(ROOT)} imports {module} unguarded"
        for package in RUNTIME_PACKAGES
        for module, path in _imported_top_levels(package)
        if module in OPTIONAL
    )
    assert unguarded == []
    used = {m for p in RUNTIME_PACKAGES for m, _ in _imported_top_levels(p, guarded=True)} & set(OPTIONAL)
    assert used, "no installed package imports an optional module: drop OPTIONAL"
    for module, extra in OPTIONAL.items():
        assert _distributions_of(module) & {canonicalize_name(r.name) for r in _requirements(extra)}


def _distributions_of(module: str) -> set[NormalizedName]:
    return {canonicalize_name(d) for d in metadata.packages_distributions().get(module, [])}


def test_every_third_party_import_comes_with_the_runtime_dependencies() -> None:
    runtime = _closure(_requirements("dependencies"))
    problems = []
    for module, files in sorted(_third_party_imports().items()):
        dists = _distributions_of(module)
        if not dists:
            problems.append(f"{module} (no installed distribution provides it): {sorted(files)}")
        elif not dists & runtime:
            problems.append(f"{module} (from {sorted(dists)}, not a runtime dependency): {sorted(files)}")
    assert not problems, "add to project.dependencies or stop importing:\n" + "\n".join(problems)


def test_every_runtime_dependency_is_imported() -> None:
    imported = set().union(*(_distributions_of(m) for m in _third_party_imports()))
    declared = {canonicalize_name(r.name) for r in _requirements("dependencies")}
    assert declared - imported == set(), "runtime dependencies nothing installed imports"


def test_no_development_tool_comes_with_the_runtime_dependencies() -> None:
    runtime = _closure(_requirements("dependencies"))
    dev = {canonicalize_name(r.name) for r in _requirements("dev")}
    bench = {canonicalize_name(r.name) for r in _requirements("bench")}
    assert runtime & (dev | bench) == set()
    # What a lean install leaves out, named, so that the intent survives edits to the lists.
    assert {"pytest", "ruff", "mypy", "openai", "matplotlib", "hypothesis", "schemathesis"} <= dev


def test_the_installed_packages_import_neither_the_benchmarks_nor_the_tests() -> None:
    leaks = sorted(
        f"{path.relative_to(ROOT)} imports {module}"
        for package in RUNTIME_PACKAGES
        for module, path in _imported_top_levels(package)
        if module in OWN - set(RUNTIME_PACKAGES)
    )
    assert leaks == []


def test_the_wheel_holds_the_runtime_packages_and_the_emulator_profiles() -> None:
    tool = _pyproject()["tool"]
    assert isinstance(tool, dict)
    setuptools = tool["setuptools"]
    assert setuptools["packages"]["find"]["include"] == [f"{p}*" for p in RUNTIME_PACKAGES]
    assert "profiles/*.yaml" in setuptools["package-data"]["simulator"]
    assert sorted((ROOT / "simulator" / "profiles").glob("*.yaml")), "the emulator ships no profile"
