"""Hooks for the whole suite: CI's guard that the e2e tests ran (``tests.support.e2e_guard``), and
every test's timeout stretched by the host-speed factor (``tests.support.speed``)."""

from __future__ import annotations

import pytest

from tests.support import speed
from tests.support.e2e_guard import register


def pytest_configure(config: pytest.Config) -> None:
    register(config)


def _base_timeout(config: pytest.Config, item: pytest.Item) -> float:
    """The timeout ``item`` would get from pytest-timeout, seconds (0: none): its ``timeout``
    marker, else ``--timeout``, else the ini's."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)
        return float(value or 0)
    option = config.getoption("timeout", default=None)
    if option is not None:
        return float(option)
    return float(config.getini("timeout") or 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Stretch every test's timeout by the host-speed factor measured at collection: the timeout
    guards against a hang, and a test that needs 100 s on an idle host needs several times that
    beside busy loops. Nothing changes on a host at least as fast as the reference."""
    slow = speed.factor()
    if slow <= 1.0:
        return
    for item in items:
        base = _base_timeout(config, item)
        if base > 0:
            marker = item.get_closest_marker("timeout")
            kwargs = {k: v for k, v in (marker.kwargs if marker else {}).items() if k != "timeout"}
            item.add_marker(pytest.mark.timeout(base * slow, **kwargs), append=False)
