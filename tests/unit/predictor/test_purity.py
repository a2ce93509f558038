"""The predictor is pure: no I/O, no clock, none of the service's libraries."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import predictor

PACKAGE = Path(predictor.__file__).parent
FORBIDDEN_PACKAGES = ("gateway", "simulator", "aiohttp", "redis", "prometheus_client")
# Modules whose use would mean I/O, clocks, randomness or concurrency inside the predictor.
FORBIDDEN_IMPORTS = (
    *FORBIDDEN_PACKAGES,
    "asyncio",
    "datetime",
    "io",
    "os",
    "pathlib",
    "random",
    "socket",
    "subprocess",
    "threading",
    "time",
    "urllib",
    "yaml",
)
SOURCES = sorted(PACKAGE.glob("*.py"))


def test_importing_the_predictor_loads_no_service_library() -> None:
    code = (
        "import json, sys\n"
        "import predictor, predictor.calibrate, predictor.observations, predictor.robust_fit\n"
        "import predictor.forecast, predictor.hardware, predictor.model\n"
        "import predictor.output_length, predictor.overhead, predictor.prompt_tokens, predictor.step_model\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(json.loads(out.stdout))
    assert loaded.isdisjoint(FORBIDDEN_PACKAGES), loaded & set(FORBIDDEN_PACKAGES)


@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_module_imports_nothing_impure(source: Path) -> None:
    tree = ast.parse(source.read_text(), filename=str(source))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint(FORBIDDEN_IMPORTS), imported & set(FORBIDDEN_IMPORTS)


@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_module_opens_no_files(source: Path) -> None:
    tree = ast.parse(source.read_text(), filename=str(source))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert calls.isdisjoint({"open", "input", "print", "exec", "eval", "__import__"})
