"""Soak: a real ``sluice serve`` under mixed load for minutes, watching its memory and descriptors.

The stack, all real processes: two emulated replicas (``python -m simulator``, profile
``llama3-8b-h100``), a ``redis-server`` on a free port with persistence off
(``tests/support/redis.py``; ``--limiter memory`` runs without it) and ``sluice serve --config``
with a file this script writes: the ``slo`` admission policy, the Redis limiter
(``on_storage_error: fail_closed``, so a Redis failure shows as a 503 in the answers instead of
hiding behind the local fallback; ``redis.timeout_s`` is ``--redis-timeout-s``, 5 s by default:
on the shared 2-core machine at load average 20-28, 1 s let through a few 503
``rate_limit_unavailable`` per 10 minutes, calls stalled by the overloaded CPU, not leaks) and
two tenants with API keys: ``steady`` (no budget limits) and ``tight`` (``requests_per_minute``
small, so most of its requests are refused with 429 ``tenant_rate_limited``: the over-budget
path). For ``--minutes`` the load runs ``--clients`` closed-loop clients, each picking per
request, at random (seeded):

* a streamed chat completion read to its end (40 %);
* a streamed chat completion the client drops after a few tokens (20 %: a disconnect mid-stream,
  the gateway must close the upstream request and free the replica slot);
* a non-streamed completion (25 %);
* a request of the over-budget tenant (15 %).

Every ``--sample-s`` seconds the gateway process's resident memory (``VmRSS`` of
``/proc/<pid>/status``) and open file descriptors (entries of ``/proc/<pid>/fd``) are sampled.
After the load, ``--idle-s`` seconds of silence, then a last sample (keep-alive connections to
the replicas may stay pooled, so a few descriptors above the pre-load baseline are normal).

Printed: RSS and fds before the load, after the warm-up (``--warmup-s``), at the end of the load,
the maximum, after idling, and the least-squares slope of RSS after the warm-up (MiB per minute);
with Redis, also ``redis-server``'s RSS before and after the load and its key count at the end
(two tenants' buckets and lease sets: it must not grow with the number of requests).
Exits 1 when RSS grew more than ``--max-growth-mib`` from the warm-up sample to the end of the
load, when fds after idling exceed the pre-load baseline plus one pooled upstream connection per
client plus ``--fd-slack`` (see ``fd_bound``), or when any answer was not a 200, a 429 or a stream
the client dropped (a 503 from a Redis call past its timeout, a 5xx, a client error).

Run: ``.venv/bin/python -m bench.soak`` (10 minutes, Redis limiter); ``--minutes 1`` for a quick
look; ``--limiter memory`` without Redis.
``tests/integration/faults/test_soak_short.py`` runs ``soak`` for about 30 seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
import numpy as np
import yaml

from gateway.tenants import hash_api_key
from tests.support.redis import redis_server

ROOT: Final = Path(__file__).resolve().parents[1]
MODEL: Final = "meta-llama/Meta-Llama-3-8B-Instruct"
PROFILE: Final = "llama3-8b-h100"
HARDWARE: Final = {"gpu": "H100-SXM", "model": "Llama-3-8B"}
STEADY_KEY: Final = "sk-soak-steady-5c1e"
TIGHT_KEY: Final = "sk-soak-tight-77a0"
LimiterKind = Literal["redis", "memory"]


# -- processes ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Poll ``url`` until it answers 200; raises if ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


@contextlib.contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``args`` running with output in ``log``; terminated (then killed) on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def emulator_args(port: int, seed: int, profile: str = PROFILE) -> list[str]:
    return [sys.executable, "-m", "simulator", "--profile", profile, "--port", str(port), "--seed", str(seed),
            "--log-level", "WARNING"]  # fmt: skip


def gateway_args(config: Path) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]


def soak_config(
    port: int, replicas: dict[str, str], redis_url: str | None = None, redis_timeout_s: float = 5.0
) -> dict[str, Any]:
    """The gateway's configuration: ``slo`` admission, the two tenants, and the Redis limiter at
    ``redis_url`` (fail-closed, calls limited to ``redis_timeout_s`` seconds), or the in-memory one
    when it is ``None``."""
    limits: dict[str, Any] = {"backend": "memory"}
    if redis_url is not None:
        limits = {
            "backend": "redis",
            "redis": {"url": redis_url, "timeout_s": redis_timeout_s},
            "on_storage_error": "fail_closed",
        }
    return {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 2.0},
        "replicas": [{"name": n, "url": u, "hardware": HARDWARE} for n, u in replicas.items()],
        "logging": {"level": "WARNING", "access_log": False},
        "tenants": {
            "tenants": {
                "steady": {"api_keys": [hash_api_key(STEADY_KEY)]},
                "tight": {"api_keys": [hash_api_key(TIGHT_KEY)], "limits": {"requests_per_minute": 6}},
            }
        },
        "limits": limits,
    }


# -- sampling -------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` (``VmRSS``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass(frozen=True)
class Sample:
    """One sample: seconds since the load started, RSS in MiB, open fds."""

    t_s: float
    rss_mib: float
    fds: int


@dataclass
class SoakReport:
    """What one soak saw. RSS in MiB, times in seconds since the load started."""

    baseline: Sample
    samples: list[Sample]
    idle: Sample
    warmup_s: float
    statuses: dict[str, int] = field(default_factory=dict)
    limiter: LimiterKind = "memory"
    redis_rss_mib: tuple[float, float] | None = None  # redis-server's RSS before and after the load
    redis_keys: int | None = None  # keys in Redis after the load

    @property
    def after_warmup(self) -> Sample:
        return next((s for s in self.samples if s.t_s >= self.warmup_s), self.samples[-1])

    @property
    def end(self) -> Sample:
        return self.samples[-1]

    @property
    def max_rss_mib(self) -> float:
        return max(s.rss_mib for s in self.samples)

    @property
    def growth_mib(self) -> float:
        """RSS at the end of the load minus RSS after the warm-up, in MiB."""
        return self.end.rss_mib - self.after_warmup.rss_mib

    @property
    def slope_mib_per_min(self) -> float:
        """Least-squares slope of RSS over the samples after the warm-up, in MiB per minute."""
        late = [s for s in self.samples if s.t_s >= self.warmup_s]
        if len(late) < 2:
            return 0.0
        slope, _ = np.polyfit([s.t_s for s in late], [s.rss_mib for s in late], 1)
        return float(slope) * 60.0

    def text(self) -> str:
        rows = [
            ("before load", self.baseline),
            ("after warm-up", self.after_warmup),
            ("end of load", self.end),
            ("after idle", self.idle),
        ]
        lines = [f"{'':>14} {'t (s)':>8} {'RSS (MiB)':>10} {'fds':>6}"]
        lines += [f"{name:>14} {s.t_s:8.1f} {s.rss_mib:10.1f} {s.fds:6d}" for name, s in rows]
        lines.append(f"max RSS {self.max_rss_mib:.1f} MiB; max fds {max(s.fds for s in self.samples)}")
        lines.append(
            f"RSS growth after warm-up {self.growth_mib:+.1f} MiB; "
            f"slope {self.slope_mib_per_min:+.2f} MiB/min"
        )
        lines.append("answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items())))
        lines.append(f"requests: {self.requests}; limiter: {self.limiter}")
        if self.redis_rss_mib is not None:
            before, after = self.redis_rss_mib
            lines.append(
                f"redis-server RSS {before:.1f} -> {after:.1f} MiB; keys after the load: {self.redis_keys}"
            )
        return "\n".join(lines)

    @property
    def requests(self) -> int:
        """Requests the clients sent (every outcome counted)."""
        return sum(self.statuses.values())


# -- load -----------------------------------------------------------------------------------------


def _chat(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me about the sea " * 8}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, counts: dict[str, int]) -> None:
    """One request of the mix; counts its outcome (status, or ``dropped``, or the error class)."""
    roll = rng.random()
    key, stream, drop_after = STEADY_KEY, True, None
    if roll < 0.2:
        drop_after = rng.randint(1, 5)
    elif roll < 0.45:
        stream = False
    elif roll >= 0.85:
        key = TIGHT_KEY
    headers = {"Authorization": f"Bearer {key}"}
    label: str
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=_chat(rng.randint(8, 48), stream=stream), headers=headers
        ) as resp:
            label = str(resp.status)
            if resp.status == 200 and stream:
                tokens = 0
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        tokens += 1
                        if drop_after is not None and tokens >= drop_after:
                            resp.close()  # the client goes away mid-stream
                            label = "dropped"
                            break
            else:
                body = await resp.read()
                if resp.status not in (200, 429):  # which error: e.g. "503 rate_limit_unavailable"
                    label = f"{resp.status} {_error_code(body)}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        label = exc.__class__.__name__
    counts[label] = counts.get(label, 0) + 1
    if label == "429":
        await asyncio.sleep(0.2)


def _error_code(body: bytes) -> str:
    """The ``error.code`` of an OpenAI-style error body, or ``?`` when it has none."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        return str(json.loads(body)["error"]["code"])
    return "?"


async def _client(url: str, end: float, seed: int, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < end:
            await _one(session, url, rng, counts)
            await asyncio.sleep(rng.uniform(0.0, 0.05))


async def _sampler(pid: int, start: float, every_s: float, out: list[Sample], stop: asyncio.Event) -> None:
    while True:
        out.append(Sample(time.monotonic() - start, rss_mib(pid), open_fds(pid)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
            out.append(Sample(time.monotonic() - start, rss_mib(pid), open_fds(pid)))
            return


async def drive(
    url: str, pid: int, *, duration_s: float, clients: int, sample_s: float, warmup_s: float, idle_s: float
) -> SoakReport:
    """Run the mix against the gateway at ``url`` (process ``pid``) and sample it (see the module)."""
    baseline = Sample(0.0, rss_mib(pid), open_fds(pid))
    counts: dict[str, int] = {}
    samples: list[Sample] = []
    stop = asyncio.Event()
    start = time.monotonic()
    sampler = asyncio.create_task(_sampler(pid, start, sample_s, samples, stop))
    await asyncio.gather(*(_client(url, start + duration_s, seed, counts) for seed in range(clients)))
    stop.set()
    await sampler
    await asyncio.sleep(idle_s)
    idle = Sample(time.monotonic() - start, rss_mib(pid), open_fds(pid))
    return SoakReport(baseline, samples, idle, warmup_s, counts)


def soak(
    *,
    duration_s: float,
    clients: int = 16,
    sample_s: float = 5.0,
    warmup_s: float = 60.0,
    idle_s: float = 5.0,
    limiter: LimiterKind = "redis",
    redis_timeout_s: float = 5.0,
) -> SoakReport:
    """Start the stack in a temporary directory (with its own ``redis-server`` when ``limiter`` is
    ``redis``), drive it for ``duration_s`` seconds, stop it."""
    with tempfile.TemporaryDirectory(prefix="sluice-soak-") as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        redis = stack.enter_context(redis_server(name="soak-redis")) if limiter == "redis" else None
        ports = {"emu-a": free_port(), "emu-b": free_port()}
        gw_port = free_port()
        config = tmp / "sluice.yaml"
        replicas = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        redis_url = redis.url if redis else None
        config.write_text(yaml.safe_dump(soak_config(gw_port, replicas, redis_url, redis_timeout_s)))
        url = f"http://127.0.0.1:{gw_port}"
        for seed, (name, port) in enumerate(ports.items(), start=1):
            emu = stack.enter_context(process(emulator_args(port, seed), tmp / f"{name}.log"))
            wait_http(f"{replicas[name]}/health", emu)
        gw = stack.enter_context(process(gateway_args(config), tmp / "gateway.log"))
        wait_http(f"{url}/readyz", gw)
        _wait_models(url)
        redis_before = rss_mib(redis.pid) if redis else None
        report = asyncio.run(
            drive(
                url,
                gw.pid,
                duration_s=duration_s,
                clients=clients,
                sample_s=sample_s,
                warmup_s=warmup_s,
                idle_s=idle_s,
            )
        )
        report.limiter = limiter
        if redis is not None and redis_before is not None:
            report.redis_rss_mib = (redis_before, rss_mib(redis.pid))
            with redis.client() as client:
                report.redis_keys = int(client.dbsize())
        return report


def _wait_models(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = urllib.request.Request(
            f"{url}/v1/models", headers={"Authorization": f"Bearer {STEADY_KEY}"}
        )
        with urllib.request.urlopen(listing, timeout=5) as resp:
            if json.loads(resp.read())["data"]:
                time.sleep(1.0)  # a scrape or two: the step model has data
                return
        time.sleep(0.1)
    raise TimeoutError("the gateway listed no model")


def fd_bound(report: SoakReport, clients: int, slack: int) -> int:
    """Most fds the gateway may hold after idling: its baseline, plus one pooled keep-alive
    connection to a replica per client that ran concurrently (aiohttp keeps idle upstream
    connections about 15 s), plus ``slack``. A leak grows with the number of requests instead."""
    return report.baseline.fds + clients + slack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration, minutes (default 10)")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients (default 16)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="sampling period, seconds (default 5)")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="warm-up, seconds (default 60)")
    parser.add_argument(
        "--idle-s", type=float, default=5.0, help="idle before the last sample, s (default 5)"
    )
    parser.add_argument(
        "--max-growth-mib", type=float, default=64.0, help="RSS growth allowed, MiB (default 64)"
    )
    parser.add_argument(
        "--fd-slack", type=int, default=8, help="fds allowed above baseline + clients after idle (default 8)"
    )
    parser.add_argument(
        "--limiter",
        choices=("redis", "memory"),
        default="redis",
        help="redis: a redis-server of its own on a free port (default); memory: the in-process limiter",
    )
    parser.add_argument(
        "--redis-timeout-s", type=float, default=5.0, help="limits.redis.timeout_s, seconds (default 5)"
    )
    args = parser.parse_args(argv)
    duration_s = args.minutes * 60.0
    warmup_s = min(args.warmup_s, duration_s / 3)
    report = soak(
        duration_s=duration_s,
        clients=args.clients,
        sample_s=args.sample_s,
        warmup_s=warmup_s,
        idle_s=args.idle_s,
        limiter=args.limiter,
        redis_timeout_s=args.redis_timeout_s,
    )
    print(report.text())
    failures = []
    if report.growth_mib > args.max_growth_mib:
        failures.append(f"RSS grew {report.growth_mib:.1f} MiB after warm-up (> {args.max_growth_mib})")
    if report.idle.fds > fd_bound(report, args.clients, args.fd_slack):
        failures.append(f"fds {report.baseline.fds} -> {report.idle.fds} after idle (a leak)")
    errors = {k: v for k, v in report.statuses.items() if k not in {"200", "429", "dropped"}}
    if errors:
        failures.append(f"answers other than 200, 429 or a dropped stream: {errors}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
