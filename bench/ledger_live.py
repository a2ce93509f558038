"""Several gateways in front of the same replicas, with the replica ledger: live, real processes.

Two emulated vLLM replicas that take 4 sequences at a time (own processes), one ``redis-server``
on a free port, and ``sluice serve`` processes with ``ledger.enabled``. The two replicas'
capacity is measured first (4 clients straight at each); then open-loop streaming chat load (the
spike's requests, ``bench.admission_load``) at ``LOAD`` x that capacity is spread round robin
over the gateways. Runs: one gateway (the reference), then three gateways with the ledger (and,
with ``--without``, three without it). While the three run, each one's admin view
(``/sluice/v1/replicas``, its ``ledger`` part) is sampled: how many of the other gateways'
requests it counts per replica. Midway one gateway is killed (SIGKILL) and the time until no
survivor counts its requests any more is measured.

Reported per run: requests sent and admitted, admitted attainment (TTFT <= the class target and
TPOT <= its target, at the client), goodput (requests that met both, per second). The live test
(``tests/integration/ledger/test_three_gateways.py``) runs the same scenario and asserts
behaviour and a generous sanity bound only; ``python -m bench.ledger_live`` prints the figures
(docs/benchmarks.md, "Replica ledger").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.admission_load import (
    SPIKE_ADMISSION,
    SPIKE_TPOT_TARGET_S,
    SPIKE_TTFT_TARGET_S,
    Result,
    chat_body,
    closed_loop_throughput,
    send,
)

__all__ = ["LOAD", "LedgerRun", "Run", "run_fleet"]

#: Offered load, as a multiple of the two replicas' measured capacity.
LOAD = 2.0
WARMUP_LOAD = 0.3
WARMUP_S = 4.0
OVERLOAD_S = 16.0
#: Into the overload, the last gateway is killed this many seconds after it started (three only).
KILL_AT_S = 9.0
LEDGER: dict[str, object] = {
    "enabled": True,
    "heartbeat_s": 0.5,
    "expiry_s": 1.5,
    "progress_interval_s": 0.25,
}


@dataclass
class Run:
    """One run: its label, the gateways, every request, and what the admin views showed."""

    label: str
    gateways: int
    ledger: bool
    results: list[Result] = field(default_factory=list)
    #: Per gateway index: the largest count of other gateways' requests its view held, all replicas.
    remote_peak: dict[int, int] = field(default_factory=dict)
    #: Per gateway index: the gateway ids its view ever counted requests of.
    remote_ids: dict[int, set[str]] = field(default_factory=dict)
    #: Gateway ids by index.
    ids: dict[int, str] = field(default_factory=dict)
    #: Seconds from the kill until no survivor counted the killed gateway's requests (None: no kill).
    ghost_gone_s: float | None = None
    #: The killed gateway's requests the survivors counted just before the kill (summed).
    ghost_before: int = 0
    logs: dict[str, str] = field(default_factory=dict)

    def overload(self) -> list[Result]:
        return [r for r in self.results if r.phase == "overload"]

    def admitted(self) -> list[Result]:
        return [r for r in self.overload() if r.status == 200 and r.error is None]

    def attainment(self) -> float:
        """Share of admitted overload requests that met both targets (NaN: none admitted)."""
        admitted = self.admitted()
        if not admitted:
            return float("nan")
        return sum(met(r) for r in admitted) / len(admitted)

    def goodput_per_s(self) -> float:
        return sum(met(r) for r in self.admitted()) / OVERLOAD_S


def met(r: Result) -> bool:
    ttft, tpot = r.ttft_s, r.tpot_s
    return ttft is not None and ttft <= SPIKE_TTFT_TARGET_S and (tpot is None or tpot <= SPIKE_TPOT_TARGET_S)


@dataclass
class LedgerRun:
    """All runs of one invocation and the replicas' measured capacity (req/s, both together)."""

    capacity_per_s: float
    runs: list[Run]


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def _processes(workdir: Path) -> Iterator[tuple[Any, list[str]]]:
    """A ``redis-server`` and two emulated 4-slot replicas; yields (redis server, replica URLs)."""
    from tests.integration.admission.conftest import start_emulator
    from tests.support.redis import redis_server

    emulators = []
    with redis_server(name="redis-ledger-live") as redis:
        try:
            emulators = [start_emulator(seed=1), start_emulator(seed=2)]
            yield redis, [e.url for e in emulators]
        finally:
            for e in emulators:
                e.proc.stop()


def _config(replicas: Sequence[str], redis_url: str, port: int, *, ledger: bool) -> dict[str, Any]:
    from tests.integration.admission.conftest import SMALL_HARDWARE

    return {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 1.0},
        "replicas": [
            {"name": f"r{i}", "url": url, "hardware": SMALL_HARDWARE} for i, url in enumerate(replicas)
        ],
        "health": {"interval_s": 1.0, "timeout_s": 0.5},
        "scrape": {"interval_s": 0.5, "timeout_s": 0.5, "window_s": 5.0},
        "reload": {"watch": False},
        "logging": {"access_log": False, "level": "INFO"},
        "admission": SPIKE_ADMISSION,
        "limits": {"redis": {"url": redis_url, "timeout_s": 0.2}},
        "ledger": LEDGER if ledger else {"enabled": False},
    }


def _start_gateways(workdir: Path, configs: list[dict[str, Any]], label: str) -> list[Any]:
    from tests.integration.admission.conftest import Running, _wait_for_model
    from tests.support.procs import Proc, python_module

    started: list[Running] = []
    try:
        for index, config in enumerate(configs):
            path = workdir / f"{label}-{index}.yaml"
            path.write_text(yaml.safe_dump(config))
            proc = Proc(
                python_module("gateway.cli", "serve", "--config", str(path)), name=f"{label}-gateway-{index}"
            )
            started.append(Running(proc, f"http://127.0.0.1:{config['server']['port']}"))
        for running in started:
            running.proc.wait_http(running.url + "/readyz", timeout_s=60)
            _wait_for_model(running.url)
    except BaseException:
        for running in started:
            running.proc.stop()
        raise
    return started


async def _drive(
    run: Run, urls: list[str], model: str, capacity: float, gateways: list[Any], seed: int
) -> None:
    """Warm-up then overload, round robin over the live gateways; samples the admin views, kills
    the last gateway at ``KILL_AT_S`` (with three), and times its entries' disappearance."""
    rng = random.Random(seed)
    alive = list(range(len(urls)))
    tasks: set[asyncio.Task[Result]] = set()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    killed: int | None = None
    killed_at = 0.0
    stop = asyncio.Event()

    async def sample() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as admin:
            while not stop.is_set():
                for index in list(alive):
                    try:
                        async with admin.get(urls[index] + "/sluice/v1/replicas") as resp:
                            body = await resp.json()
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        continue
                    ledger = body.get("ledger")
                    if ledger is None:
                        continue
                    run.ids[index] = ledger["gateway"]
                    held = ledger["replicas"]
                    total = sum(r["in_flight"] for r in held.values())
                    run.remote_peak[index] = max(run.remote_peak.get(index, 0), total)
                    ids = {g for r in held.values() for g in r["gateways"]}
                    run.remote_ids.setdefault(index, set()).update(ids)
                    if killed is None and len(urls) > 1:
                        run.ghost_before = max(run.ghost_before, _held_by(body, run.ids.get(len(urls) - 1)))
                await asyncio.sleep(0.1)

    def _held_by(body: dict[str, Any], gateway: str | None) -> int:
        if gateway is None:
            return 0
        return sum(r["gateways"].get(gateway, 0) for r in body["ledger"]["replicas"].values())

    async def watch_ghost() -> None:
        """After the kill: poll every survivor until none counts the killed gateway's requests."""
        assert killed is not None
        ghost = run.ids.get(killed)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as admin:
            while run.ghost_gone_s is None and not stop.is_set():
                counts = []
                for index in alive:
                    try:
                        async with admin.get(urls[index] + "/sluice/v1/replicas") as resp:
                            counts.append(_held_by(await resp.json(), ghost))
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        counts.append(-1)
                if all(c == 0 for c in counts):
                    run.ghost_gone_s = time.monotonic() - killed_at
                    return
                await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    ghost_task: asyncio.Task[None] | None = None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sent = 0
        for phase, rate, duration in (
            ("warmup", WARMUP_LOAD * capacity, WARMUP_S),
            ("overload", LOAD * capacity, OVERLOAD_S),
        ):
            start = time.monotonic()
            end = start + duration
            next_at = start
            while True:
                next_at += rng.expovariate(rate)
                if next_at >= end:
                    break
                if (
                    phase == "overload"
                    and killed is None
                    and len(urls) == 3
                    and run.ledger
                    and next_at - start >= KILL_AT_S
                ):
                    killed = len(urls) - 1
                    alive.remove(killed)
                    gateways[killed].proc.popen.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                    ghost_task = asyncio.create_task(watch_ghost())
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                url = urls[alive[sent % len(alive)]]
                sent += 1
                body = chat_body(model, rng.randint(100, 400), 48, rng)
                result = Result(phase, time.monotonic())
                run.results.append(result)
                task = asyncio.create_task(send(session, url, body, result))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(max(0.0, end - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=120)
    if ghost_task is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ghost_task, timeout=10.0)
    stop.set()
    await sampler


def run_fleet(workdir: Path, *, without: bool = False, seed: int = 11) -> LedgerRun:
    """Measure capacity, then run one gateway, three with the ledger (and three without it with
    ``without``) on the same load; every process is stopped before this returns."""
    from tests.integration.admission.conftest import MODEL
    from tests.support.procs import free_port

    plans = [("one", 1, False), ("three-ledger", 3, True)]
    if without:
        plans.append(("three-no-ledger", 3, False))
    runs: list[Run] = []
    with _processes(workdir) as (redis, replicas):

        async def capacity_of() -> float:
            both = await asyncio.gather(
                *(closed_loop_throughput(url, MODEL, concurrency=4, duration_s=4.0) for url in replicas)
            )
            return float(sum(both))

        capacity = asyncio.run(capacity_of())
        for label, count, ledger in plans:
            run = Run(label, count, ledger)
            configs = [_config(replicas, redis.url, free_port(), ledger=ledger) for _ in range(count)]
            gateways = _start_gateways(workdir, configs, label)
            try:
                asyncio.run(_drive(run, [g.url for g in gateways], MODEL, capacity, gateways, seed))
            finally:
                for g in gateways:
                    g.proc.stop()
                    run.logs[g.proc.name] = g.proc.output()[-3000:]
            runs.append(run)
            time.sleep(1.0)  # the replicas drain
    return LedgerRun(capacity, runs)


def summary(result: LedgerRun) -> str:
    lines = [
        f"two replicas, capacity {result.capacity_per_s:.1f} req/s together; overload {LOAD:g}x for "
        f"{OVERLOAD_S:g} s, round robin over the gateways",
        "| run | sent | admitted | admitted attainment | goodput (req/s) | others' requests seen (peak) |",
        "|---|---|---|---|---|---|",
    ]
    for run in result.runs:
        overload = run.overload()
        peaks = ", ".join(str(run.remote_peak.get(i, 0)) for i in range(run.gateways)) if run.ledger else "-"
        lines.append(
            f"| {run.label} | {len(overload)} | {len(run.admitted())} | {run.attainment():.3f} | "
            f"{run.goodput_per_s():.2f} | {peaks} |"
        )
    for run in result.runs:
        if run.ghost_gone_s is not None or (run.ledger and run.gateways == 3):
            gone = "never" if run.ghost_gone_s is None else f"{run.ghost_gone_s:.2f} s"
            lines.append(
                f"{run.label}: killed gateway's requests counted by the survivors before the kill "
                f"(peak) {run.ghost_before}; gone from every survivor's view {gone} after kill -9 "
                f"(heartbeat {LEDGER['heartbeat_s']} s, expiry {LEDGER['expiry_s']} s)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without", action="store_true", help="also run three gateways without the ledger")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sluice-ledger-live-") as workdir:
        result = run_fleet(Path(workdir), without=args.without, seed=args.seed)
    print(summary(result))


if __name__ == "__main__":
    main()
