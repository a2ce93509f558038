"""Real processes for integration tests: free ports, start, wait until ready, stop, show logs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support import speed

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class Proc:
    """A child process with its output in a temporary file, stopped by `stop()`."""

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None, name: str = "proc"):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"sluice-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            list(args),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=ROOT,
            start_new_session=True,
        )

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def output_with(self, text: str, timeout_s: float = 10.0, *, count: int = 1) -> str:
        """The output once it holds ``text`` at least ``count`` times (polled; lines below WARNING
        reach it up to the gateway's log flush interval later, ``ACCESS_FLUSH_INTERVAL_S``); fails
        with the output after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.output()
            if out.count(text) >= count:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} never logged {text!r}:\n{out[-3000:]}")
            time.sleep(0.02)

    def wait_http(self, url: str, timeout_s: float = 60.0) -> None:
        """Poll `url` until it answers 200; fail with the process log otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.output()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(url, timeout=1.0) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout_s}s:\n{self.output()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Signal the process (not its group) and wait; SIGKILL the group if it hangs."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        return int(self.popen.returncode)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


@contextlib.contextmanager
def running(args: Sequence[str], ready_url: str, *, name: str, timeout_s: float = 60.0) -> Iterator[Proc]:
    proc = Proc(args, name=name)
    try:
        proc.wait_http(ready_url, timeout_s)
        yield proc
    finally:
        proc.stop()


def run_bench(
    args: Sequence[str], *, timeout_s: float, what: str, stop_timeout_s: float = 60.0
) -> tuple[int, str]:
    """Run a benchmark's command line from the project root to its end: (exit status, output,
    stdout and stderr together). Both bounds are the reference host's, stretched here by the
    host-speed factor (``tests.support.speed``): past ``timeout_s`` the bench gets SIGTERM (it
    then stops the servers it started), ``stop_timeout_s`` later SIGKILL, and the test fails with
    ``what``, how it stopped, the factor and the output's tail."""
    timeout_s, stop_timeout_s = speed.scaled(timeout_s), speed.scaled(stop_timeout_s)
    with subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                output, _ = proc.communicate(timeout=stop_timeout_s)
                stopped = f"stopped by SIGTERM (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
                stopped = "killed: it did not stop on SIGTERM (vLLM may be left running)"
            pytest.fail(
                f"{what} still running after {timeout_s:.0f} s "
                f"(host-speed factor {speed.factor():.2f}), {stopped}:\n{output[-4000:]}"
            )
    return proc.returncode, output
