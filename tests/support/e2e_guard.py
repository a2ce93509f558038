"""CI's guard that the e2e tests really ran: a pytest plugin active when ``SLUICE_REQUIRE_E2E=1``.

A skip in a fixture, a ``pytest.skip`` in a test, a crash before the call phase or a marker
expression that deselects everything would otherwise leave CI green with the real-vLLM suite
never run. With the variable set, the session fails (exit status 1, a section in the terminal
summary naming them) when

* a selected test marked ``e2e`` was skipped (``xfail`` is a result, not a skip) or never reached
  its call phase (``-x`` stopped the run first, a setup error);
* no test marked ``e2e`` was selected although ``tests/e2e`` (under the root directory) was
  part of the run: named on the command line or through ``testpaths``, or collected.

Tests deselected (``-m``, ``-k``, ``--deselect``) are not the session's to run and do not count.
``--collect-only`` runs nothing and is left alone. ``tests/conftest.py`` registers it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.skips import REQUIRE_E2E_ENV

PLUGIN_NAME = "sluice-require-e2e"
E2E_MARK = "e2e"


def register(config: pytest.Config) -> None:
    """Register :class:`RequireE2E` with ``config`` when ``SLUICE_REQUIRE_E2E=1`` (once)."""
    if os.environ.get(REQUIRE_E2E_ENV) == "1" and not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(RequireE2E(config), PLUGIN_NAME)


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


class RequireE2E:
    """Records every selected ``e2e`` test's outcome; fails the session when one did not run."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.e2e_dir = config.rootpath / "tests" / "e2e"
        self.selected: dict[str, None] = {}  # node ids, in run order
        self.ran: set[str] = set()
        self.skipped: dict[str, str] = {}
        self.saw_e2e_dir = self._named_on_command_line()
        self.problems: list[str] = []

    def _named_on_command_line(self) -> bool:
        """True when a path the session was asked to collect contains, or lies in, ``tests/e2e``."""
        here = self.config.invocation_params.dir
        for arg in self.config.args:
            path = (here / arg.split("::", 1)[0]).resolve()
            if _within(self.e2e_dir, path) or _within(path, self.e2e_dir):
                return True
        return False

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        if _within(Path(item.path), self.e2e_dir):
            self.saw_e2e_dir = True

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.selected = {item.nodeid: None for item in session.items if item.get_closest_marker(E2E_MARK)}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.selected:
            return
        if report.skipped and not hasattr(report, "wasxfail"):
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.skipped[report.nodeid] = reason.splitlines()[0] if reason else "skipped"
        elif report.when == "call":
            self.ran.add(report.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.config.option.collectonly:
            return
        self.problems = self._problems()
        if self.problems and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _problems(self) -> list[str]:
        if not self.selected:
            if not self.saw_e2e_dir:
                return []
            return [
                f"no test marked {E2E_MARK} was selected although {self.e2e_dir} is part of the run "
                "(deselected by -m or -k, or nothing collected); unset "
                f"{REQUIRE_E2E_ENV} to run a subset without them"
            ]
        lines = []
        for nodeid in self.selected:
            if nodeid in self.skipped:
                lines.append(f"{nodeid}: skipped: {self.skipped[nodeid]}")
            elif nodeid not in self.ran:
                lines.append(f"{nodeid}: never reached its call phase")
        return lines

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.problems:
            return
        terminalreporter.write_sep("=", f"{REQUIRE_E2E_ENV}=1: e2e tests did not run", red=True)
        for line in self.problems:
            terminalreporter.write_line(line)
