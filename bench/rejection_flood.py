"""How many 429s one gateway process answers per second while admitted traffic keeps flowing.

The stack, all real processes: one emulated replica (``tests/data/profiles/llama3-8b-h100-seqs4
.yaml``: 4 sequences at a time) and ``sluice serve --config`` pinned to ONE core (``taskset -c``).
Then, for ``--duration`` seconds:

* **admitted traffic**: 4 closed-loop clients streaming 64-token completions (the replica's
  capacity) with no deadline: they keep the replica full and must keep succeeding;
* **the flood**: ``--workers`` client processes, each with ``--connections`` keep-alive
  connections sending back to back chat completions with ``x-sluice-deadline-ms: 50``: with the
  replica full their first token cannot come within 50 ms, so admission refuses them (429
  ``deadline_exceeded``, a Retry-After from the forecast) after the full decision path (tenant,
  class, estimates, forecast on the replica, Retry-After).

Figures, from the gateway's own ``/metrics`` and ``/proc/<pid>/stat``:

* **429/s**: rejections the gateway counted, divided by the wall-clock duration (bounded by how
  fast the clients on the other core can send);
* **gateway CPU**: CPU seconds the gateway process used / duration (1.0 = its core is saturated);
* **429 per CPU-second**: rejections / CPU seconds used: the rate one core sustains when the
  gateway is the bottleneck (the issue's target: >= 5,000 per second on one core).

Run: ``.venv/bin/python -m bench.rejection_flood`` (``--access-log`` off/on compares the cost of
the per-request log lines). Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.admission_load import Result, chat_body, quantile, send

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "data" / "profiles" / "llama3-8b-h100-seqs4.yaml"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
HARDWARE = {"gpu": "H100-SXM", "model": "Llama-3-8B", "max_num_seqs": 4, "max_num_batched_tokens": 8192}
TARGET_PER_CPU_S = 5000.0
FLOOD_HEADERS = {"x-sluice-deadline-ms": "50"}


@dataclass(frozen=True)
class Figures:
    """One run's numbers."""

    label: str
    duration_s: float
    rejected: int
    gateway_cpu_s: float
    flood_sent: int
    flood_statuses: dict[int, int]
    admitted_ok: int
    admitted_failed: int
    admitted_ttft_p50_s: float

    @property
    def rejected_per_s(self) -> float:
        return self.rejected / self.duration_s

    @property
    def cpu_share(self) -> float:
        return self.gateway_cpu_s / self.duration_s

    @property
    def rejected_per_cpu_s(self) -> float:
        return self.rejected / self.gateway_cpu_s if self.gateway_cpu_s > 0 else float("nan")


# -- processes ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready")


@contextlib.contextmanager
def _process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
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


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _rejected(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_requests":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("decision") == "rejected":
                    total += sample.value
    return int(total)


# -- clients ------------------------------------------------------------------------------------------
async def _flood(url: str, connections: int, duration_s: float) -> dict[str, int]:
    """``connections`` loops posting back to back until ``duration_s`` passes; status counts."""
    counts: dict[str, int] = {}
    body = json.dumps(chat_body(MODEL, 40, 16, random.Random(0))).encode()
    headers = {"Content-Type": "application/json", **FLOOD_HEADERS}
    end = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            while time.monotonic() < end:
                try:
                    async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as r:
                        await r.read()
                        key = str(r.status)
                except aiohttp.ClientError:
                    key = "error"
                counts[key] = counts.get(key, 0) + 1

        await asyncio.gather(*(loop() for _ in range(connections)))
    return counts


def _flood_worker(url: str, connections: int, duration_s: float, out: Any) -> None:
    out.put(asyncio.run(_flood(url, connections, duration_s)))


async def _admitted(url: str, duration_s: float) -> list[Result]:
    """Four closed-loop streaming clients (the replica's capacity), no deadline."""
    rng = random.Random(1)
    results: list[Result] = []
    end = time.monotonic() + duration_s
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while time.monotonic() < end:
                r = Result("admitted", time.monotonic())
                results.append(r)
                await send(session, url, chat_body(MODEL, 100, 64, rng), r)
                if r.status == 429:
                    await asyncio.sleep(float(r.headers.get("retry-after-ms", "100")) / 1000)

        await asyncio.gather(*(client() for _ in range(4)))
    return results


# -- one run ------------------------------------------------------------------------------------------
def run(*, duration_s: float, workers: int, connections: int, access_log: bool, core: int) -> Figures:
    with tempfile.TemporaryDirectory(prefix="sluice-flood-") as tmp_dir:
        tmp = Path(tmp_dir)
        emu_port, gw_port = _free_port(), _free_port()
        emulator = [sys.executable, "-m", "simulator", "--profile", str(PROFILE), "--port", str(emu_port)]
        config = {
            "server": {"port": gw_port},
            "replicas": [{"name": "emu", "url": f"http://127.0.0.1:{emu_port}", "hardware": HARDWARE}],
            "logging": {"access_log": access_log},
        }
        (tmp / "sluice.yaml").write_text(yaml.safe_dump(config))
        gateway = ["taskset", "-c", str(core), sys.executable, "-m", "gateway.cli", "serve"]
        gateway += ["--config", str(tmp / "sluice.yaml")]
        url = f"http://127.0.0.1:{gw_port}"
        with _process(emulator, tmp / "emulator.log") as emu, _process(gateway, tmp / "gateway.log") as gw:
            _wait_http(f"http://127.0.0.1:{emu_port}/health", emu)
            _wait_http(f"{url}/readyz", gw)
            time.sleep(2.0)  # a couple of scrapes: the step model has data
            return _measure(url, gw.pid, duration_s, workers, connections, "on" if access_log else "off")


def _measure(url: str, pid: int, duration_s: float, workers: int, connections: int, label: str) -> Figures:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    admitted_box: list[list[Result]] = []

    async def admitted_then_wait() -> None:
        admitted_box.append(await _admitted(url, duration_s + 2.0))

    procs = [
        ctx.Process(target=_flood_worker, args=(url, connections, duration_s, out)) for _ in range(workers)
    ]
    runner = asyncio.new_event_loop()
    admitted_task = runner.create_task(admitted_then_wait())
    runner.run_until_complete(asyncio.sleep(1.0))  # admitted traffic fills the replica first
    before_rejected, before_cpu, start = _rejected(url), _cpu_seconds(pid), time.monotonic()
    for p in procs:
        p.start()
    counts: dict[str, int] = {}
    runner.run_until_complete(asyncio.sleep(duration_s))
    for _ in procs:
        for key, n in out.get(timeout=60).items():
            counts[key] = counts.get(key, 0) + n
    elapsed = time.monotonic() - start
    rejected, cpu = _rejected(url) - before_rejected, _cpu_seconds(pid) - before_cpu
    for p in procs:
        p.join(10)
    runner.run_until_complete(admitted_task)
    runner.close()
    admitted = admitted_box[0]
    ok = [r for r in admitted if r.status == 200 and r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return Figures(
        label=label,
        duration_s=elapsed,
        rejected=rejected,
        gateway_cpu_s=cpu,
        flood_sent=sum(counts.values()),
        flood_statuses={int(k): v for k, v in counts.items() if k.isdigit()},
        admitted_ok=len(ok),
        admitted_failed=len([r for r in admitted if r.status not in (200, 429) or r.error]),
        admitted_ttft_p50_s=quantile(ttft, 0.5),
    )


def table(rows: list[Figures]) -> str:
    head = (
        f"{'access log':>10} {'429/s':>8} {'gw CPU':>7} {'429/CPU-s':>10} {'flood sent':>10} "
        f"{'admitted ok':>11} {'failed':>6} {'adm TTFT p50':>12}"
    )
    lines = [head, "-" * len(head)]
    for f in rows:
        lines.append(
            f"{f.label:>10} {f.rejected_per_s:8.0f} {f.cpu_share:7.2f} {f.rejected_per_cpu_s:10.0f} "
            f"{f.flood_sent:10d} {f.admitted_ok:11d} {f.admitted_failed:6d} "
            f"{f.admitted_ttft_p50_s * 1e3:10.1f} ms"
        )
    lines.append(f"target: >= {TARGET_PER_CPU_S:.0f} rejections per CPU-second of the gateway (one core)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of flood per run")
    parser.add_argument("--workers", type=int, default=2, help="flood client processes")
    parser.add_argument("--connections", type=int, default=64, help="connections per flood process")
    parser.add_argument("--core", type=int, default=0, help="CPU the gateway is pinned to")
    parser.add_argument("--access-log", choices=["on", "off", "both"], default="both")
    args = parser.parse_args(argv)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.access_log]
    rows = [
        run(
            duration_s=args.duration,
            workers=args.workers,
            connections=args.connections,
            access_log=mode,
            core=args.core,
        )
        for mode in modes
    ]
    print(table(rows))
    for f in rows:
        print(f"access log {f.label}: flood statuses {f.flood_statuses}")


if __name__ == "__main__":
    main()
