"""``VllmServer.bind_engine_core`` binds the engine-core process's threads, and only them.

Real processes, no vLLM: a parent that starts two children, one named as vLLM names its engine
core (``/proc/self/comm``) with a second thread, one named otherwise. Linux only (``/proc``,
``sched_setaffinity``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.vllm_cpu import ENGINE_CORE_COMM, VllmServer
from tests.support.skips import skip_or_fail


@pytest.fixture(autouse=True)
def _linux_proc() -> None:
    if not Path("/proc/self/comm").exists():
        skip_or_fail("this platform has no /proc/self/comm", install="run the suite on Linux")


#: A child that renames itself, starts a second thread, says so, and sleeps.
_CHILD = """
import sys, threading, time
open("/proc/self/comm", "w").write(sys.argv[1])
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""

#: A parent (the stand-in for the API server) that starts both children and waits.
_PARENT = f"""
import subprocess, sys, time
child = {_CHILD!r}
procs = [subprocess.Popen([sys.executable, "-c", child, name], stdout=subprocess.PIPE, text=True)
         for name in ({ENGINE_CORE_COMM!r}, "APIWorker")]
for p in procs:
    p.stdout.readline()
print(" ".join(str(p.pid) for p in procs), flush=True)
time.sleep(60)
"""


def _threads(pid: int) -> list[int]:
    return [int(t.name) for t in (Path("/proc") / str(pid) / "task").iterdir()]


def test_only_the_engine_cores_threads_are_bound(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout is not None
        engine, other = (int(pid) for pid in parent.stdout.readline().split())
        server = VllmServer(port=0, process=parent, log_path=tmp_path / "log")
        core = cores[-1]
        bound = server.bind_engine_core(core)
        assert sorted(bound) == sorted(_threads(engine))
        assert len(bound) == 2  # its main thread and the second one
        for task in _threads(engine):
            assert os.sched_getaffinity(task) == {core}
        for task in _threads(other) + _threads(parent.pid):
            assert os.sched_getaffinity(task) == set(cores)
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(timeout=10)


def test_a_server_without_an_engine_core_process_binds_nothing(tmp_path: Path) -> None:
    lone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        server = VllmServer(port=0, process=lone, log_path=tmp_path / "log")
        assert server.bind_engine_core(0) == []
        assert os.sched_getaffinity(lone.pid) == os.sched_getaffinity(0)
    finally:
        lone.kill()
        lone.wait(timeout=10)
