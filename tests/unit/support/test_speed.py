"""The host-speed factor (tests/support/speed.py): its arithmetic, its cache, and that it rises
when the host is busy."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.support import speed

#: Busy processes pinned beside the measurement.
BUSY = 8


@pytest.fixture
def uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no cached factor; the session's value is put back afterwards."""
    monkeypatch.setattr(speed, "_cached", None)


def test_the_workload_is_deterministic() -> None:
    assert speed.workload() == speed.workload()
    assert speed.workload(100) != speed.workload(200)


def test_the_factor_is_the_measured_ratio_and_never_below_one(
    uncached: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(speed, "measure", lambda: 3.0 * speed.REFERENCE_S)
    assert speed.factor() == pytest.approx(3.0)
    assert speed.scaled(2.0) == pytest.approx(6.0)
    monkeypatch.setattr(speed, "_cached", None)
    monkeypatch.setattr(speed, "measure", lambda: 0.5 * speed.REFERENCE_S)
    assert speed.factor() == 1.0
    monkeypatch.setattr(speed, "_cached", None)
    monkeypatch.setattr(speed, "measure", lambda: math.nan)
    assert speed.factor() == 1.0


def test_the_factor_is_cached_and_a_fresh_one_never_shrinks(
    uncached: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = iter([4.0, 9.0, 2.0])
    monkeypatch.setattr(speed, "measure", lambda: next(values) * speed.REFERENCE_S)
    assert speed.factor() == pytest.approx(4.0)
    assert speed.factor() == pytest.approx(4.0)  # cached: the 9.0 is not measured
    assert speed.factor(fresh=True) == pytest.approx(9.0)
    assert speed.factor(fresh=True) == pytest.approx(9.0)  # 2.0 measured, the larger kept


def test_the_real_factor_is_finite_and_at_least_one(uncached: None) -> None:
    value = speed.factor()
    assert math.isfinite(value)
    assert value >= 1.0


def test_busy_processes_on_the_same_core_raise_the_measurement() -> None:
    # All on one core, so the busy loops take most of it whatever else the host runs: with k other
    # runnable tasks there the expected ratio is (k + 1 + BUSY) / (k + 1), 1.5 even at k = 15.
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    busy: list[subprocess.Popen[bytes]] = []
    try:
        alone = speed.measure()
        for _ in range(BUSY):
            busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(busy[-1].pid, {core})
        speed.measure(repeats=4)  # let the busy processes get going
        shared = speed.measure()
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        os.sched_setaffinity(0, before)
    print(f"workload mean alone {alone * 1e3:.2f} ms, beside {BUSY} busy loops {shared * 1e3:.2f} ms")
    assert shared > 1.2 * alone
