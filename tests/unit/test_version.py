"""``sluice --version`` prints the installed package's version (its metadata, not a constant)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.http.openapi import openapi_spec
from gateway.version import UNKNOWN_VERSION, package_version


def test_the_version_is_the_installed_metadata() -> None:
    assert package_version() == metadata.version("sluice") != UNKNOWN_VERSION


def test_main_prints_the_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"sluice {metadata.version('sluice')}\n"


def test_the_console_script_prints_it() -> None:
    script = Path(sys.executable).with_name("sluice")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"sluice {metadata.version('sluice')}\n", "")


def test_the_openapi_document_carries_it() -> None:
    assert openapi_spec()["info"]["version"] == metadata.version("sluice")
