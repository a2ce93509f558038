"""``sluice serve`` with ``server.workers: 2``: two gateway processes on one port in front of one
emulated replica the supervisor starts once.

One run, in order: requests (a new connection each) until both workers have answered some, the
host's ``/metrics`` counting exactly the requests sent; a change to the file and a SIGHUP each
reaching both workers (two reloads counted per event); a worker killed outright being restarted,
its counts kept; a stream in flight finishing through SIGTERM's drain, then every process (the
supervisor, its workers, the emulator) gone. Counts, not timings: the bounds are generous for a
busy 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import Proc, free_port, port_is_open

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def _config(port: int, emulator_port: int, header: str, redis_url: str) -> dict[str, object]:
    """Two workers in front of one emulator, sharing the replica ledger on ``redis_url`` (budgets,
    if any, in memory: each worker's share)."""
    server = {"port": port, "workers": 2, "drain_s": 1.0, "shutdown_grace_s": 20.0, "server_header": header}
    emulator = {"name": "emu-0", "profile": "llama3-8b-h100", "port": emulator_port, "seed": 0, "jitter": 0.0}
    return {
        "server": server,
        "emulators": [emulator],
        "limits": {"redis": {"url": redis_url, "timeout_s": 1.0}},
        "ledger": {"enabled": True},
        "reload": {"poll_interval_s": 0.2},
        "logging": {"access_log": False},
    }


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A real ``redis-server`` on a free port for the module's workers (their ledger, a budget)."""
    from tests.support.redis import RedisNotInstalled, redis_server

    try:
        with redis_server(name="redis-workers") as server:
            yield server.url
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


def _until(what: str, check: Callable[[], bool], proc: Proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}\n{proc.output()[-4000:]}")
        time.sleep(0.1)


def _complete(base: str, max_tokens: int = 2) -> int:
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "connection": "close"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        return int(resp.status)


def _metrics(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in metrics.items() if n == name and all((k, val) in ls for k, val in labels.items())
    )


def _counted(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> tuple[float, float]:
    """(requests the host's counters agree on, or -1 where they differ; replica requests in flight).

    A worker counts a request just after its answer went out, and the other worker's live gauges
    come from the snapshot it writes every second: a scrape right after the last answer can
    precede both, so a test waits for the counts rather than reading them once."""
    counts = {
        _total(metrics, name)
        for name in (
            "sluice_worker_requests_total",
            "sluice_requests_total",
            "sluice_request_duration_seconds_count",
        )
    }
    return (counts.pop() if len(counts) == 1 else -1.0), _total(metrics, "sluice_replica_in_flight_requests")


def _per_worker(base: str) -> dict[str, float]:
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in _metrics(base).items()
        if name == "sluice_worker_requests_total"
    }


def _workers_up(base: str) -> set[str]:
    """The workers whose metrics snapshot is there: their app has started (written every second)."""
    return {
        dict(labels)["worker"]
        for (name, labels), _ in _metrics(base).items()
        if name == "process_start_time_seconds" and "worker" in dict(labels)
    }


def _worker_pids(proc: Proc) -> dict[int, int]:
    """Worker index -> pid of its latest start, from the supervisor's log."""
    return {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) started \(pid (\d+)\)", proc.output())}


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (an exited process nobody reaped yet, a zombie, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def served(tmp_path: Path, redis_url: str) -> Iterator[tuple[Proc, str, Path, int]]:
    port, emulator_port = free_port(), free_port()
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump(_config(port, emulator_port, "sluice", redis_url)), encoding="utf-8")
    proc = Proc([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], name="workers")
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=120)
        yield proc, f"http://127.0.0.1:{port}", config, emulator_port
    finally:
        proc.stop(signal.SIGTERM, timeout_s=60)


def test_two_workers_share_the_port_the_metrics_reloads_and_the_shutdown(
    served: tuple[Proc, str, Path, int], redis_url: str
) -> None:
    proc, base, config, emulator_port = served
    _until("both workers started", lambda: len(_worker_pids(proc)) == 2, proc)

    # Both workers answer: the kernel spreads new connections over the two listeners.
    sent = 0
    deadline = time.monotonic() + 120
    while not (len(seen := _per_worker(base)) == 2 and min(seen.values()) > 0):
        assert time.monotonic() < deadline, f"one worker never answered: {seen}\n{proc.output()[-4000:]}"
        for _ in range(4):
            assert _complete(base) == 200
            sent += 1
    _until("every request counted once, none in flight", lambda: _counted(_metrics(base)) == (sent, 0), proc)
    metrics = _metrics(base)
    assert _total(metrics, "sluice_worker_requests_total") == sent
    assert _total(metrics, "sluice_requests_total") == sent
    assert _total(metrics, "sluice_request_duration_seconds_count") == sent
    assert _total(metrics, "sluice_replica_in_flight_requests") == 0

    # A change to the file: each worker watches it and reloads it.
    reloaded = _config(0, 0, "sluice-reloaded", redis_url) | _keep(config)
    config.write_text(yaml.safe_dump(reloaded), encoding="utf-8")
    _until(
        "both workers reloaded the changed file",
        lambda: _total(_metrics(base), "sluice_config_reloads_total", result="success") == 2,
        proc,
    )
    assert _header(base) == "sluice-reloaded"
    # SIGHUP to the supervisor reaches both workers: two more reloads (nothing to change).
    os.kill(proc.popen.pid, signal.SIGHUP)
    _until(
        "both workers reloaded on SIGHUP",
        lambda: _total(_metrics(base), "sluice_config_reloads_total", result="success") == 4,
        proc,
    )

    # A worker killed outright is restarted; what it counted stays in the host's totals.
    first = _worker_pids(proc)
    os.kill(first[1], signal.SIGKILL)
    _until("worker 1 restarted", lambda: _worker_pids(proc).get(1, first[1]) != first[1], proc)
    assert f"worker 1 (pid {first[1]}) exited unexpectedly with -9" in proc.output()
    assert _total(_metrics(base), "sluice_worker_requests_total") == sent
    workers = _worker_pids(proc)

    # SIGTERM drains: a stream in flight ends whole; then everything is gone.
    streamed: dict[str, object] = {}
    started = threading.Event()
    reader = threading.Thread(target=_stream, args=(base, streamed, started), daemon=True)
    reader.start()
    assert started.wait(60), streamed
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(90) == 0, proc.output()[-4000:]
    reader.join(60)
    assert streamed.get("done") is True, streamed
    assert all(not _alive(pid) for pid in workers.values()), workers
    _until("the emulator stopped", lambda: not port_is_open(emulator_port), proc, timeout_s=20)
    log = proc.output()
    assert "SIGTERM: stopping the 2 workers" in log
    assert "without ledger.enabled" not in log
    assert "draining for 1.0 s" in log


def _keep(config: Path) -> dict[str, object]:
    """The running file's listener and emulator (restart-only keys), so a reload changes only the header."""
    running = yaml.safe_load(config.read_text(encoding="utf-8"))
    server = {**running["server"], "server_header": "sluice-reloaded"}
    return {"server": server, "emulators": running["emulators"]}


def _header(base: str) -> str:
    with urllib.request.urlopen(f"{base}/healthz", timeout=30) as resp:
        return str(resp.headers["Server"])


def _stream(base: str, out: dict[str, object], started: threading.Event) -> None:
    """One streamed completion long enough to be in flight at SIGTERM; ``out["done"]`` once its
    ``[DONE]`` arrived."""
    body = {
        "model": MODEL,
        "max_tokens": 300,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if line.startswith(b"data: "):
                    started.set()
                if line.strip() == b"data: [DONE]":
                    out["done"] = True
    except (OSError, urllib.error.URLError) as exc:
        out["error"] = repr(exc)
    finally:
        started.set()


def test_a_supervisor_killed_outright_leaves_no_worker_or_emulator(tmp_path: Path, redis_url: str) -> None:
    """``kill -9`` of the supervisor passes no signal on: each worker notices its parent is gone
    and stops (draining), the emulator stops by itself (``--parent-pid``)."""
    port, emulator_port = free_port(), free_port()
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump(_config(port, emulator_port, "sluice", redis_url)), encoding="utf-8")
    proc = Proc([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], name="workers")
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=120)
        _until("both workers started", lambda: len(_worker_pids(proc)) == 2, proc)
        workers = _worker_pids(proc)
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(30)
        _until("every worker gone", lambda: not any(_alive(pid) for pid in workers.values()), proc)
        _until("the port closed", lambda: not port_is_open(port), proc, timeout_s=20)
        _until("the emulator stopped", lambda: not port_is_open(emulator_port), proc, timeout_s=20)
        assert proc.output().count("is gone: stopping") == 2
    finally:
        proc.stop(signal.SIGKILL)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_two_workers_hold_a_tenant_to_one_budget(tmp_path: Path, backend: str, redis_url: str) -> None:
    """A tenant's request budget (6 a minute) is held across both workers: in Redis one budget,
    in memory each worker's half of it. 40 requests spread over them (a new connection each, each
    worker answering at least 7) get exactly 6 served, plus the refill (1 per 10 s), where two
    whole budgets would have served 12; the host's gauge shows the one bucket of 6."""
    from gateway.tenants import hash_api_key

    with contextlib.ExitStack() as stack:
        port, emulator_port = free_port(), free_port()
        settings = _config(port, emulator_port, "sluice", redis_url)
        limits = {"requests_per_minute": 6}
        settings["tenants"] = {"tenants": {"t": {"api_keys": [hash_api_key("sk-workers")], "limits": limits}}}
        if backend == "redis":
            settings["limits"] = {"backend": "redis", "redis": {"url": redis_url, "timeout_s": 1.0}}
        config = tmp_path / "sluice.yaml"
        config.write_text(yaml.safe_dump(settings), encoding="utf-8")
        proc = Proc([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], name="workers")
        stack.callback(proc.stop, signal.SIGTERM, 60)
        base = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{base}/readyz", timeout_s=120)
        _until("both workers serve", lambda: _workers_up(base) == {"0", "1"}, proc)
        time.sleep(0.5)  # a worker binds its listener just after its app has started
        started = time.monotonic()
        codes = [_status(base, "sk-workers") for _ in range(40)]
        elapsed = time.monotonic() - started
        _until("all 40 requests counted", lambda: sum(_per_worker(base).values()) == 40, proc)
        per_worker = _per_worker(base)
        # Each worker writes its tenant gauges with its snapshot, every second.
        capacity = ("sluice_tenant_bucket_capacity", (("bucket", "requests"), ("tenant", "t")))
        _until("the host's bucket of 6", lambda: _metrics(base).get(capacity) == 6, proc, timeout_s=30)
        if backend == "memory":
            assert "each worker keeps 1/2 of every tenant budget" in proc.output()
    assert set(codes) <= {200, 429}, codes
    assert sum(per_worker.values()) == 40, per_worker
    assert min(per_worker.values()) >= 7, per_worker  # each alone would have served a whole 6
    assert 6 <= codes.count(200) <= 6 + int(elapsed / 10) + 1, (codes, elapsed)


def _status(base: str, key: str) -> int:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "connection": "close", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)
