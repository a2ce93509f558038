"""``tests/conftest.py`` stretches every test's timeout by the host-speed factor.

Each case runs a small pytest session (``pytester``, in this process) whose conftest installs the
suite's hook, with the factor pinned (``tests.support.speed``'s cache), and a test that reads the
timeout pytest-timeout will apply to it.
"""

from __future__ import annotations

import pytest

from tests.support import speed

pytest_plugins = ["pytester"]

CONFTEST = """
from tests.conftest import pytest_collection_modifyitems
"""
INI = """
[pytest]
timeout = 300
asyncio_default_fixture_loop_scope = function
"""
TESTS = """
import pytest

def timeout_of(request):
    return request.node.get_closest_marker("timeout")

def test_ini_timeout(request):
    assert timeout_of(request).args[0] == pytest.approx(300 * FACTOR)

@pytest.mark.timeout(20, method="thread")
def test_marked_timeout(request):
    marker = timeout_of(request)
    assert marker.args[0] == pytest.approx(20 * FACTOR)
    assert marker.kwargs == {"method": "thread"}

@pytest.mark.timeout(0)
def test_no_timeout_stays_none(request):
    assert timeout_of(request).args[0] == 0
"""

FAST_TESTS = """
import pytest

def test_ini_timeout_is_left_to_the_ini(request):
    assert request.node.get_closest_marker("timeout") is None

@pytest.mark.timeout(20, method="thread")
def test_marked_timeout_is_unchanged(request):
    marker = request.node.get_closest_marker("timeout")
    assert (marker.args, marker.kwargs) == ((20,), {"method": "thread"})
"""


@pytest.fixture
def factor_pinned(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(speed, "_cached", 3.0)
    return 3.0


def test_timeouts_are_stretched_by_the_factor(pytester: pytest.Pytester, factor_pinned: float) -> None:
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(TESTS.replace("FACTOR", repr(factor_pinned)))
    pytester.runpytest_inprocess("-p", "no:randomly").assert_outcomes(passed=3)


def test_a_fast_host_keeps_the_configured_timeouts(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(speed, "_cached", 1.0)
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(FAST_TESTS)
    pytester.runpytest_inprocess("-p", "no:randomly").assert_outcomes(passed=2)
