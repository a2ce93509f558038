"""Replica emulators Sluice starts itself (``emulators:`` in the settings; demo and development).

Each emulator is ``python -m simulator --profile P --port N --host H [--seed S] --jitter J
--parent-pid GATEWAY`` in its own process group, so a Ctrl-C in the terminal reaches only the
gateway, which then stops the emulators itself after it has drained its own requests; a gateway
killed outright (SIGKILL) leaves none running, as each stops once its parent is gone. Startup
waits until every emulator's ``/health`` answers; a failure names the emulator and shows the tail
of its output. Stopping sends SIGTERM to the group, then SIGKILL after ``grace_s`` seconds.

Changes to ``emulators:`` in a reloaded file take effect on restart only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

import aiohttp

from gateway.replicas.config import EmulatorSettings

log = logging.getLogger("sluice.emulators")

#: Seconds to wait for an emulator's ``/health`` after starting it.
READY_TIMEOUT_S = 30.0
#: Seconds between SIGTERM and SIGKILL when stopping.
STOP_GRACE_S = 5.0
#: Lines of an emulator's output kept for error messages.
TAIL_LINES = 40

CommandFactory = Callable[[EmulatorSettings], list[str]]


class EmulatorStartError(RuntimeError):
    """An emulator did not come up; the message names it and shows the tail of its output."""


def emulator_command(emulator: EmulatorSettings) -> list[str]:
    """The argv that starts ``emulator`` with this interpreter, as a child of this process."""
    argv = [sys.executable, "-m", "simulator", "--profile", emulator.profile]
    argv += ["--port", str(emulator.port), "--host", emulator.host]
    if emulator.seed is not None:
        argv += ["--seed", str(emulator.seed)]
    if emulator.engine != "vllm":
        argv += ["--engine", emulator.engine]
    else:
        # Its answers then say which prompt tokens hit its prefix cache, as vLLM's do with the
        # flag: what admission's prefix index learns from (docs/admission.md, "Prefix caching").
        argv += ["--enable-prompt-tokens-details"]
    # --parent-pid: the emulator stops by itself if this gateway dies without stopping it.
    return [*argv, "--jitter", repr(emulator.jitter), "--parent-pid", str(os.getpid())]


class EmulatorProcess:
    """One running emulator child process and the tail of what it printed."""

    def __init__(self, settings: EmulatorSettings, process: asyncio.subprocess.Process) -> None:
        self.settings = settings
        self.process = process
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        # An exit is reported by ``wait_ready`` before readiness, by the output reader after it.
        self._ready = False
        self._stopping = False
        self._reader = asyncio.create_task(self._read_output(), name=f"emulator-{settings.name}-output")

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    @classmethod
    async def start(
        cls, settings: EmulatorSettings, *, command: CommandFactory = emulator_command
    ) -> EmulatorProcess:
        """Spawn the process (own session and process group); does not wait for readiness."""
        argv = command(settings)
        log.info("starting emulator %s: %s", settings.name, " ".join(argv))
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        return cls(settings, process)

    async def output_done(self) -> None:
        """Wait until the process has exited and all its output has been read."""
        await asyncio.shield(self._reader)

    def tail(self) -> str:
        """The last ``TAIL_LINES`` lines the emulator wrote to stdout or stderr."""
        return "\n".join(self._tail)

    async def _read_output(self) -> None:
        stream = self.process.stdout
        if stream is None:
            return
        child_log = logging.getLogger(f"sluice.emulators.{self.name}")
        while line := await stream.readline():
            text = line.decode("utf-8", errors="replace").rstrip()
            self._tail.append(text)
            child_log.debug("%s", text)
        code = await self.process.wait()
        if self._ready and not self._stopping:
            # Its replica turns unhealthy through the health checks; this says why.
            log.warning(
                "emulator %s exited unexpectedly (code %s); last output:\n%s", self.name, code, self.tail()
            )

    async def wait_ready(self, session: aiohttp.ClientSession, *, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Return once ``/health`` answers 200; raise ``EmulatorStartError`` on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.returncode is not None:
                await self._drain_output()
                raise self._error(f"exited with code {self.process.returncode} before answering /health")
            if await self._healthy(session):
                self._ready = True
                log.info("emulator %s ready at %s", self.name, self.url)
                return
            if time.monotonic() >= deadline:
                raise self._error(f"did not answer {self.url}/health within {timeout_s:g} s")
            await asyncio.sleep(0.1)

    async def _healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _drain_output(self) -> None:
        # The reader ends at EOF once the process is gone; give it a moment to take the last lines.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), 1.0)

    def _error(self, what: str) -> EmulatorStartError:
        tail = self.tail() or "(no output)"
        return EmulatorStartError(
            f"emulator {self.name!r} (profile {self.settings.profile!r}, port {self.settings.port}) "
            f"{what}; last output:\n{tail}"
        )

    async def stop(self, *, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s`` s; returns the exit code."""
        self._stopping = True
        if self.process.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), grace_s)
            except TimeoutError:
                log.warning("emulator %s ignored SIGTERM for %g s; killing it", self.name, grace_s)
                self._signal(signal.SIGKILL)
                await self.process.wait()
        else:
            # The leader is gone, but children it left in the group must not outlive the gateway.
            self._signal(signal.SIGKILL)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        log.info("emulator %s stopped (exit code %s)", self.name, self.process.returncode)
        return self.process.returncode

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


async def start_emulators(
    emulators: Sequence[EmulatorSettings],
    session: aiohttp.ClientSession,
    *,
    command: CommandFactory = emulator_command,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> list[EmulatorProcess]:
    """Start all emulators at once and wait until each answers ``/health``.

    As soon as one fails, waiting stops, every emulator started so far is stopped and
    ``EmulatorStartError`` is raised (naming each emulator that had failed by then).
    """
    started: list[EmulatorProcess] = []
    try:
        for settings in emulators:
            started.append(await EmulatorProcess.start(settings, command=command))
        await _wait_all_ready(started, session, ready_timeout_s)
    except BaseException:
        await stop_emulators(started)
        raise
    return started


async def _wait_all_ready(
    processes: Sequence[EmulatorProcess], session: aiohttp.ClientSession, timeout_s: float
) -> None:
    waits = [asyncio.create_task(p.wait_ready(session, timeout_s=timeout_s)) for p in processes]
    if not waits:
        return
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    failures = [exc for w in done if not w.cancelled() and (exc := w.exception()) is not None]
    if len(failures) == 1 or any(not isinstance(f, EmulatorStartError) for f in failures):
        raise failures[0]
    if failures:
        raise EmulatorStartError("\n\n".join(str(f) for f in failures))


async def stop_emulators(processes: Sequence[EmulatorProcess], *, grace_s: float = STOP_GRACE_S) -> None:
    """Stop all of them concurrently (each: SIGTERM, then SIGKILL after ``grace_s`` s)."""
    await asyncio.gather(*(p.stop(grace_s=grace_s) for p in processes))
