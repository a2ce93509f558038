"""Helpers for the tests that run Debian's ``prometheus`` and ``promtool`` (see deploy/ci/system-deps.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support.procs import ROOT
from tests.support.skips import skip_or_fail

DEPLOY = ROOT / "deploy" / "prometheus"
CONFIG = DEPLOY / "prometheus.yml"
RULES = sorted((DEPLOY / "rules").glob("*.yml"))
RULE_TESTS = sorted((DEPLOY / "tests").glob("*.yml"))
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
INSTALL_HINT = "run `bash deploy/ci/system-deps.sh` (as root): it installs Debian's prometheus package"


def tool(name: str) -> str:
    """The path of ``name`` (``prometheus`` or ``promtool``).

    Missing: the test skips with the install command, except in CI (``SLUICE_CI=1``, set by
    ``.ci/run``), where it fails (``tests.support.skips``): CI installs them with
    deploy/ci/system-deps.sh.
    """
    found = shutil.which(name)
    if found is None:
        skip_or_fail(f"{name} is not installed", install=INSTALL_HINT)
    return found


def promtool(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``promtool`` with ``args``; the result, whatever its exit status."""
    return subprocess.run(
        [tool("promtool"), *map(str, args)], capture_output=True, text=True, timeout=60, check=False, cwd=cwd
    )
