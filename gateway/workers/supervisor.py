"""The supervisor of ``server.workers`` > 1: N gateway processes on one port, one parent.

``supervise(settings, argv, workers)`` runs in the process ``sluice serve`` started:

* it checks the listener can be bound (``SO_REUSEPORT``), prepares the metrics directory
  (``PROMETHEUS_MULTIPROC_DIR``: the one given, emptied, else a temporary one removed at exit)
  and starts ``emulators:`` once, for all workers;
* it starts each worker as ``python -m gateway.cli ARGV`` (the same command line) in a session of
  its own, told its index and the supervisor's pid (``gateway.workers``), so a Ctrl-C in the
  terminal reaches the supervisor only;
* SIGTERM and SIGINT are passed on to every worker as SIGTERM (each drains as one gateway does:
  ``server.drain_s``, then ``server.shutdown_grace_s``), a second signal likewise (each then stops
  at once); SIGHUP is passed on, so every worker reloads its file (each also watches it itself);
* a worker that exits while nobody asked is logged with its exit status and restarted after a
  back-off (``RESTART_BACKOFF_S``, doubling to ``RESTART_BACKOFF_MAX_S``, reset once it has run
  ``STABLE_S``); after ``MAX_QUICK_FAILURES`` quick failures in a row of one worker, the supervisor
  stops them all and exits 1 (a worker that can never start is not restarted for ever);
* once every worker has exited it stops the emulators and returns.

A worker whose supervisor is killed outright stops by itself, draining (``gateway.serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gateway.config.settings import Settings
from gateway.workers import COUNT_ENV, PARENT_ENV, WORKER_ENV

__all__ = ["supervise"]

log = logging.getLogger("sluice.workers")

#: Seconds before the first restart of a worker that died; doubled at each quick failure in a row.
RESTART_BACKOFF_S: Final = 0.5
#: Longest wait before restarting a worker, in seconds.
RESTART_BACKOFF_MAX_S: Final = 30.0
#: A worker that ran this long (seconds) before exiting counts as started: its back-off resets.
STABLE_S: Final = 30.0
#: Quick failures in a row of one worker after which the supervisor gives up and stops.
MAX_QUICK_FAILURES: Final = 5
#: Seconds a worker may take beyond its drain and grace to exit after SIGTERM before SIGKILL.
STOP_MARGIN_S: Final = 15.0

_MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    quick_failures: int = 0
    waiter: asyncio.Task[int] | None = field(default=None, repr=False)


class _Supervisor:
    def __init__(self, settings: Settings, argv: Sequence[str], workers: int, directory: Path) -> None:
        self._settings = settings
        self._argv = list(argv)
        self._workers = [_Worker(i) for i in range(workers)]
        self._directory = directory
        self._stopping = False
        self._signals = 0
        self._failed = False
        self._wake = asyncio.Event()

    # -- workers -----------------------------------------------------------------------------------

    async def _start(self, worker: _Worker) -> None:
        env = {
            **os.environ,
            WORKER_ENV: str(worker.index),
            PARENT_ENV: str(os.getpid()),
            COUNT_ENV: str(len(self._workers)),
            _MULTIPROC_ENV: str(self._directory),
        }
        worker.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", *self._argv, env=env, start_new_session=True
        )
        worker.started = time.monotonic()
        worker.waiter = asyncio.create_task(worker.process.wait(), name=f"sluice-worker-{worker.index}")
        worker.waiter.add_done_callback(lambda _task: self._wake.set())
        log.info("worker %d started (pid %d)", worker.index, worker.process.pid)
        if self._stopping:  # a signal came while it started: it was not there to be told
            worker.process.send_signal(signal.SIGTERM)

    def _send(self, signum: signal.Signals) -> None:
        for worker in self._workers:
            process = worker.process
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    def _on_stop_signal(self, signum: signal.Signals) -> None:
        self._signals += 1
        if not self._stopping:
            log.info("%s: stopping the %d workers (each drains)", signum.name, len(self._workers))
        self._stopping = True
        self._send(signal.SIGTERM)
        self._wake.set()

    def _on_sighup(self) -> None:
        log.info("SIGHUP: passing it on to the %d workers (each reloads its file)", len(self._workers))
        self._send(signal.SIGHUP)

    def _exited(self, worker: _Worker) -> None:
        """Account for a worker that has exited: forget its metrics process, log, back-off."""
        from gateway.observability.metrics.multiprocess import worker_gone

        process = worker.process
        assert process is not None
        worker_gone(self._directory, process.pid, worker.index)
        ran = time.monotonic() - worker.started
        worker.process, worker.waiter = None, None
        if self._stopping:
            log.info("worker %d (pid %d) exited with %s", worker.index, process.pid, process.returncode)
            return
        worker.quick_failures = 1 if ran >= STABLE_S else worker.quick_failures + 1
        log.warning(
            "worker %d (pid %d) exited unexpectedly with %s after %.1f s",
            worker.index,
            process.pid,
            process.returncode,
            ran,
        )
        if worker.quick_failures >= MAX_QUICK_FAILURES:
            log.error("worker %d failed %d times in a row: stopping all", worker.index, worker.quick_failures)
            self._failed = True
            self._stopping = True
            self._send(signal.SIGTERM)

    def _backoff_s(self, worker: _Worker) -> float:
        return float(min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2.0 ** (worker.quick_failures - 1)))

    async def _restart_later(self, worker: _Worker) -> None:
        delay = self._backoff_s(worker)
        log.info("restarting worker %d in %.1f s", worker.index, delay)
        await asyncio.sleep(delay)
        if not self._stopping:
            await self._start(worker)
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        restarts: set[asyncio.Task[None]] = set()
        try:
            for worker in self._workers:
                await self._start(worker)
            deadline: float | None = None
            while True:
                self._wake.clear()
                for worker in self._workers:
                    if worker.process is not None and worker.process.returncode is not None:
                        self._exited(worker)
                        if not self._stopping:
                            task = asyncio.create_task(self._restart_later(worker))
                            restarts.add(task)
                            task.add_done_callback(restarts.discard)
                if self._stopping:
                    if deadline is None:
                        server = self._settings.server
                        deadline = time.monotonic() + server.drain_s + server.shutdown_grace_s + STOP_MARGIN_S
                    if all(w.process is None for w in self._workers):
                        break
                    if time.monotonic() >= deadline:
                        log.warning("workers still running %.0f s after SIGTERM: killing them", STOP_MARGIN_S)
                        self._send(signal.SIGKILL)
                        deadline = time.monotonic() + STOP_MARGIN_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
        finally:
            for task in restarts:
                task.cancel()
            await asyncio.gather(*restarts, return_exceptions=True)
            if any(w.process is not None for w in self._workers):
                self._send(signal.SIGKILL)
                for worker in self._workers:
                    if worker.process is not None:
                        await worker.process.wait()
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
        return 1 if self._failed else 0


def check_bind(host: str, port: int) -> None:
    """Bind ``host:port`` with ``SO_REUSEPORT`` and let it go: raises ``OSError`` when the workers
    could not (the port is taken by another program, or the address is not this host's)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))


#: The temporary metrics directories' names: ``sluice-metrics-<supervisor pid>-<random>``.
_TEMP_PREFIX: Final = "sluice-metrics-"


def _metrics_directory() -> tuple[Path, bool]:
    """(the multiprocess metrics directory, whether the supervisor made it and removes it)."""
    from gateway.observability.metrics.multiprocess import clear_directory

    given = os.environ.get(_MULTIPROC_ENV, "").strip()
    if given:
        directory = Path(given)
        directory.mkdir(parents=True, exist_ok=True)
        clear_directory(directory)
        return directory, False
    _sweep_orphaned_directories(Path(tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-")), True


def _sweep_orphaned_directories(parent: Path) -> None:
    """Remove the temporary metrics directories of supervisors that are gone (killed outright,
    they could not remove their own); one whose pid runs again, whoever runs it, is kept."""
    for path in parent.glob(f"{_TEMP_PREFIX}*-*"):
        pid_text = path.name.removeprefix(_TEMP_PREFIX).split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue  # another user's live process


async def _supervise(settings: Settings, argv: Sequence[str], workers: int) -> int:
    import aiohttp

    from gateway.replicas.emulators import start_emulators, stop_emulators

    directory, made = _metrics_directory()
    emulators = []
    try:
        if settings.emulators:
            async with aiohttp.ClientSession(trust_env=False) as session:
                emulators = await start_emulators(settings.emulators, session)
        log.info(
            "supervisor (pid %d): %d workers on %s:%d, metrics in %s",
            os.getpid(),
            workers,
            settings.server.host,
            settings.server.port,
            directory,
        )
        return await _Supervisor(settings, argv, workers, directory).run()
    finally:
        await stop_emulators(emulators)
        if made:
            shutil.rmtree(directory, ignore_errors=True)


def supervise(settings: Settings, argv: Sequence[str], workers: int) -> int:
    """Run ``workers`` gateway processes with ``argv`` (``serve ...``, as given to ``sluice``)
    until SIGTERM or SIGINT; returns the exit code (0, or 1 when a worker kept failing). Raises
    ``OSError`` when the listener cannot be bound and ``EmulatorStartError`` when an emulator
    does not come up."""
    check_bind(settings.server.host, settings.server.port)
    if settings.admin.port is not None:
        check_bind(settings.admin.host, settings.admin.port)
    return asyncio.run(_supervise(settings, argv, workers))
