"""The supervisor's restarts: a worker that keeps failing at start is restarted with back-off,
then given up on (exit 1) after ``MAX_QUICK_FAILURES`` failures in a row, every attempt logged.
The workers are real processes: ``sluice serve`` of a file that does not exist exits 2 at once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from gateway.config.load import parse_settings
from gateway.workers import supervisor
from gateway.workers.supervisor import MAX_QUICK_FAILURES, _Supervisor


@pytest.mark.slow
def test_a_worker_that_keeps_failing_is_restarted_then_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", 0.01)
    settings = parse_settings({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}]}, "f")
    argv = ["serve", "--config", str(tmp_path / "missing.yaml")]
    with caplog.at_level(logging.INFO, logger="sluice.workers"):
        code = asyncio.run(asyncio.wait_for(_Supervisor(settings, argv, 1, tmp_path).run(), 120))
    assert code == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("exited unexpectedly with 2" in m for m in messages) == MAX_QUICK_FAILURES
    assert sum(m.startswith("restarting worker 0 in") for m in messages) == MAX_QUICK_FAILURES - 1
    assert f"worker 0 failed {MAX_QUICK_FAILURES} times in a row: stopping all" in messages


def test_the_back_off_doubles_to_its_cap() -> None:
    settings = parse_settings({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}]}, "f")
    sup = _Supervisor(settings, [], 1, Path("."))
    worker = sup._workers[0]
    delays = []
    for failures in (1, 2, 3, 12):
        worker.quick_failures = failures
        delays.append(sup._backoff_s(worker))
    assert delays == [0.5, 1.0, 2.0, 30.0]


def test_a_dead_supervisors_metrics_directory_is_swept(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f"sluice-metrics-{int(gone.stdout)}-abc"
    alive = tmp_path / f"sluice-metrics-{os.getpid()}-def"
    other = tmp_path / "sluice-metrics-notapid"
    for path in (dead, alive, other):
        path.mkdir()
    supervisor._sweep_orphaned_directories(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])
