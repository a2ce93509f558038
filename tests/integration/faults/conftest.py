"""Fixtures of the fault tests: each test gets its own ``redis-server`` (see ``rig.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.faults.rig import Ledger
from tests.support.redis import RedisNotInstalled, RedisServer, redis_server


@pytest.fixture
def redis_proc() -> Iterator[RedisServer]:
    """A fresh ``redis-server`` on a free port; a missing binary fails the test (CI must run it)."""
    try:
        with redis_server(name="redis-faults") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


@pytest.fixture
def ledger(redis_proc: RedisServer) -> Ledger:
    return Ledger(redis_proc)
