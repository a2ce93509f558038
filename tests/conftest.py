"""Hooks for the whole suite: CI's guard that the e2e tests ran (``tests.support.e2e_guard``)."""

from __future__ import annotations

import pytest

from tests.support.e2e_guard import register


def pytest_configure(config: pytest.Config) -> None:
    register(config)
