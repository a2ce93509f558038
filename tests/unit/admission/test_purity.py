"""The admission core is pure: no I/O, no clock, none of the service's I/O libraries.

The package's aiohttp adapters (``ADAPTERS``) are the exception; the core never imports them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gateway.admission

PACKAGE = Path(gateway.admission.__file__).parent
FORBIDDEN_PACKAGES = ("aiohttp", "redis", "prometheus_client", "simulator", "yaml")
# Modules whose use would mean I/O, clocks, randomness or concurrency inside the core.
FORBIDDEN_IMPORTS = (
    *FORBIDDEN_PACKAGES,
    "asyncio",
    "datetime",
    "io",
    "logging",
    "os",
    "pathlib",
    "random",
    "socket",
    "subprocess",
    "threading",
    "time",
    "urllib",
)
#: The only other gateway modules the core may use: the settings base classes (pydantic only)
#: and their package, whose ``__init__`` imports nothing.
ALLOWED_GATEWAY_MODULES = {"gateway.config", "gateway.config.settings", "gateway.config.section"}
#: The package's live adapters: they drive the core from aiohttp (futures, the loop's timer,
#: headers), so they are the one place in it allowed I/O. Nothing in the core imports them.
ADAPTERS = {"live.py", "live_budget.py", "live_queue.py", "sizing.py"}
SOURCES = sorted(p for p in PACKAGE.glob("*.py") if p.name not in ADAPTERS)


def test_importing_the_core_loads_no_service_library() -> None:
    code = "import json, sys\nimport gateway.admission\nprint(json.dumps(sorted({m for m in sys.modules})))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(json.loads(out.stdout))
    roots = {m.split(".")[0] for m in loaded}
    assert roots.isdisjoint(FORBIDDEN_PACKAGES), roots & set(FORBIDDEN_PACKAGES)
    gateway_modules = {
        m for m in loaded if m.startswith("gateway.") and not m.startswith("gateway.admission")
    }
    assert gateway_modules <= ALLOWED_GATEWAY_MODULES, gateway_modules


@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_module_imports_nothing_impure(source: Path) -> None:
    tree = ast.parse(source.read_text(), filename=str(source))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
    roots = {name.split(".")[0] for name in imported}
    assert roots.isdisjoint(FORBIDDEN_IMPORTS), roots & set(FORBIDDEN_IMPORTS)
    gateway_modules = {
        m for m in imported if m.startswith("gateway") and not m.startswith("gateway.admission")
    }
    assert gateway_modules <= ALLOWED_GATEWAY_MODULES, gateway_modules


@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_module_opens_no_files(source: Path) -> None:
    tree = ast.parse(source.read_text(), filename=str(source))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert calls.isdisjoint({"open", "input", "print", "exec", "eval", "__import__"})
