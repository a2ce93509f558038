"""The cycle collector's work inside ``sluice serve`` under load: how often it runs, how long the
event loop stops for it, and what that does to the latency's tail; this checkout against others.

CPython's cycle collector runs inside whatever allocates the container that crosses a generation's
threshold; while it runs, the event loop does nothing else. A full (generation 2) collection visits
every container the process holds. This bench measures it from inside the gateway without touching
its code: each configuration runs ``gateway.cli`` (from this checkout, or from another one with
``--tree``) under a small shim that records every collection with ``gc.callbacks`` (generation,
start and length, objects found) and writes them out when the process exits. Only collections
that start while the load runs count.

Each configuration is the overhead bench's "sluice" (everything on: API keys, Redis token buckets,
SLO admission with predictions, prediction headers, ``/metrics``, the access log) in front of its
fast fake backend, driven by its closed-loop client: JSON at concurrency 32, then streams at
concurrency 32. The gateway is pinned to one CPU and everything else to the others, as in the
overhead bench. Configurations are taken in turn, reversed every other round.

Reported per configuration and scenario: requests/s, latency p50/p99/p99.9, collections per 1,000
requests by generation, milliseconds of collection per 1,000 requests, and the longest pause.

Run: ``.venv/bin/python -m bench.gc_pauses [--tree before=DIR] [--rounds 2] [--duration 6]``, where
DIR is e.g. ``git archive <commit> | tar x -C DIR``. ``--quick``: one short round (CI smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.overhead import core, peers
from bench.overhead.load import closed_loop
from tests.support.procs import free_port
from tests.support.redis import redis_server

ROOT = Path(__file__).resolve().parents[1]

#: Run ``gateway.cli`` from the working directory (the tree under test), recording every collection
#: (time.monotonic() at its start, generation, seconds, objects collected) to $SLUICE_GC_LOG at exit.
SHIM = """\
import atexit, gc, json, os, sys, time
sys.path.insert(0, os.getcwd())
_started = [0.0]
_log = []
def _on_gc(phase, info):
    if phase == "start":
        _started[0] = time.monotonic()
    else:
        _log.append((_started[0], info["generation"], time.monotonic() - _started[0], info["collected"]))
gc.callbacks.append(_on_gc)
def _write():
    with open(os.environ["SLUICE_GC_LOG"], "w") as out:
        json.dump(_log, out)
atexit.register(_write)
from gateway.cli import main
sys.exit(main(sys.argv[1:]))
"""

SCENARIOS = (("json c=32", False), ("stream c=32", True))


@dataclass
class Cell:
    """One configuration in one scenario, over the rounds."""

    requests_per_s: list[float] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    requests: int = 0
    #: (generation, seconds) of every collection that started during the load.
    pauses: list[tuple[int, float]] = field(default_factory=list)


def _one_round(
    trees: dict[str, Path],
    layout: peers.Layout,
    cells: dict[tuple[str, str], Cell],
    duration_s: float,
    order: list[str],
) -> None:
    for name in order:
        gc_log = layout.work / f"{name}.gc.json"
        target = peers.start_sluice(
            layout,
            tree=trees[name],
            name=name,
            launcher=[sys.executable, "-c", SHIM],
            env={"SLUICE_GC_LOG": str(gc_log)},
        )
        windows: list[tuple[str, float, float]] = []
        try:
            for label, stream in SCENARIOS:
                url = target.url + "/v1/chat/completions"
                result = asyncio.run(
                    closed_loop(
                        url, core.body(stream, 16), target.headers, concurrency=32, duration_s=duration_s
                    )
                )
                end = time.monotonic()
                if result.errors:
                    raise RuntimeError(f"{name} {label}: errors {result.errors}")
                # closed_loop counts the last duration_s seconds: the collections in that window.
                windows.append((label, end - duration_s, end))
                cell = cells[name, label]
                cell.requests_per_s.append(result.requests_per_s)
                cell.latencies_s += result.latencies_s
                cell.requests += result.ok
                print(f"{name:>12} {label:<12} {result.requests_per_s:7.0f} req/s", flush=True)
        finally:
            peers.stop(target.proc)
        log: list[tuple[float, int, float, int]] = json.loads(gc_log.read_text())
        for label, begin, end in windows:
            cells[name, label].pauses += [(gen, secs) for at, gen, secs, _ in log if begin <= at < end]


def _table(trees: dict[str, Path], cells: dict[tuple[str, str], Cell]) -> list[str]:
    rows = [
        "| scenario | configuration | req/s | p50 ms | p99 ms | p99.9 ms | collections per 1k requests "
        "(gen 0 / 1 / 2) | collector ms per 1k requests | longest pause ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, _ in SCENARIOS:
        for name in trees:
            cell = cells[name, label]
            lat = np.array(cell.latencies_s) * 1e3
            per_k = 1000.0 / max(cell.requests, 1)
            counts = [sum(1 for g, _ in cell.pauses if g == gen) * per_k for gen in (0, 1, 2)]
            total_ms = sum(s for _, s in cell.pauses) * 1e3 * per_k
            longest = max((s for _, s in cell.pauses), default=0.0) * 1e3
            p50, p99, p999 = np.quantile(lat, [0.5, 0.99, 0.999])
            rows.append(
                f"| {label} | {name} | {statistics.median(cell.requests_per_s):.0f} | "
                f"{p50:.2f} | {p99:.2f} | {p999:.2f} | "
                f"{counts[0]:.2f} / {counts[1]:.2f} / {counts[2]:.3f} | {total_ms:.1f} | {longest:.1f} |"
            )
    return rows


def _version(tree: Path) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree, check=False
    )
    return done.stdout.strip() if done.returncode == 0 else str(tree)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR", help="another checkout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds measured per scenario")
    parser.add_argument("--quick", action="store_true", help="one round of 1 s per scenario")
    args = parser.parse_args(argv)
    rounds, duration = (1, 1.0) if args.quick else (args.rounds, args.duration)
    trees = {"this": ROOT}
    for item in args.tree:
        label, _, path = item.partition("=")
        if not label or not path or not Path(path, "gateway", "cli.py").is_file():
            parser.error(f"--tree takes LABEL=DIR with DIR a Sluice checkout (got {item!r})")
        trees[label] = Path(path).resolve()
    proxy_cpus, load_cpus, pinning = core.cpu_layout(None)
    pinning = pinning.replace(", the load generator and py-spy", " and the load generator")  # no py-spy
    cells = {(name, label): Cell() for name in trees for label, _ in SCENARIOS}
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    own_affinity = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="sluice-gc-") as tmp, redis_server(name="redis-gc") as redis:
        work = Path(tmp)
        peers.pin_all_threads(redis.pid, load_cpus)
        backend_port = free_port()
        backend_args = [sys.executable, "-m", "bench.overhead.backend", "--port", str(backend_port)]
        backend = peers.start(peers.pinned(load_cpus, backend_args), work / "backend.log")
        try:
            backend_url = f"http://127.0.0.1:{backend_port}"
            peers.wait_ready(backend_url + "/health", backend, work / "backend.log")
            layout = peers.Layout(proxy_cpus, load_cpus, work, backend_url, redis.url, redis.port)
            if load_cpus:
                os.sched_setaffinity(0, {int(c) for c in load_cpus.split(",")})
            for round_ in range(rounds):
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                _one_round(trees, layout, cells, duration, order)
        finally:
            os.sched_setaffinity(0, own_affinity)
            peers.stop(backend)
    command = " ".join([".venv/bin/python -m bench.gc_pauses", *(argv if argv is not None else sys.argv[1:])])
    info: dict[str, Any] = core.machine()
    print()
    print(f"Measured {started} with `{command}`: {rounds} round(s), {duration:g} s per scenario.")
    print(f"- Machine: {'; '.join(f'{k} {v}' for k, v in info.items())}")
    print(f"- Pinning: {pinning}")
    print(f"- Trees: {'; '.join(f'{name}: {_version(tree)}' for name, tree in trees.items())}")
    print()
    print("\n".join(_table(trees, cells)))


if __name__ == "__main__":
    main()
