"""``tests.support.procs.run_bench``: a bench run to its end, or stopped with its output kept."""

from __future__ import annotations

import sys

import pytest

from tests.support import speed
from tests.support.procs import run_bench


def test_a_run_that_ends_gives_its_status_and_output() -> None:
    code = "import sys; print('done'); sys.exit(3)"
    ran = run_bench([sys.executable, "-c", code], timeout_s=30.0, stop_timeout_s=5.0, what="x")
    assert ran == (3, "done\n")


def test_a_run_past_its_bound_is_stopped_and_fails_with_its_output() -> None:
    code = "import time; print('started', flush=True); time.sleep(60)"
    with pytest.raises(pytest.fail.Exception) as failed:
        run_bench([sys.executable, "-c", code], timeout_s=2.0, stop_timeout_s=10.0, what="the sleeper")
    message = str(failed.value)
    assert f"the sleeper still running after {speed.scaled(2.0):.0f} s" in message
    assert "stopped by SIGTERM" in message
    assert "started" in message


def test_a_run_that_ignores_sigterm_is_killed() -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('stubborn', flush=True); time.sleep(60)"
    )
    with pytest.raises(pytest.fail.Exception) as failed:
        run_bench([sys.executable, "-c", code], timeout_s=2.0, stop_timeout_s=1.0, what="it")
    assert "killed: it did not stop on SIGTERM" in str(failed.value)
    assert "stubborn" in str(failed.value)
