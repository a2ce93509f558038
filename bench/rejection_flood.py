"""How many 429s one gateway process answers per second while admitted traffic keeps flowing.

The stack, all real processes: one emulated replica (``tests/data/profiles/llama3-8b-h100-seqs4
.yaml``: 4 sequences at a time) and ``sluice serve --config`` pinned to ONE core (``taskset -c
--core``). Everything else (the emulator, this process with its admitted clients, the flood
processes) is pinned to the machine's OTHER cores, so the clients never steal the gateway's core
(on a one-core machine nothing can be kept apart: the output says so). Then, for ``--duration``
seconds:

* **admitted traffic**: 4 closed-loop clients streaming 64-token completions (the replica's
  capacity) with no deadline: they keep the replica full and must keep succeeding;
* **the flood**: ``--workers`` client processes, each with ``--connections`` keep-alive
  connections sending back to back chat completions with ``x-sluice-deadline-ms: 50`` (a minimal
  HTTP/1.1 client on a raw asyncio protocol: the request's bytes are built once and a response is
  read by its ``Content-Length``, so one client core can outpace the gateway's core; aiohttp's
  client costs more per request than the gateway's rejection): with the
  replica full their first token cannot come within 50 ms, so admission refuses them (429
  ``deadline_exceeded``, a Retry-After from the forecast) after the full decision path (tenant,
  class, estimates, forecast on the replica, Retry-After).

Figures, from the gateway's own ``/metrics`` and ``/proc/<pid>/stat``:

* **429/s**: rejections the gateway counted, divided by the wall-clock duration (bounded by how
  fast the clients on the other core can send);
* **gateway CPU**: CPU seconds the gateway process used / duration (1.0 = its core is saturated),
  and the kernel's share of it (``sys``: the loopback sockets' send and receive work);
* **429 per CPU-second**: rejections / CPU seconds used: the rate one core sustains when the
  gateway is the bottleneck (the refusal path's target: >= 5,000 per second on one core);
* **bg CPU** and **us/429 added**: the gateway's CPU share with the admitted traffic alone (2 s
  just before the flood: scrapes, the admitted streams, timers), and its CPU beyond that per
  rejection. On a busy machine the flood's rate drops, the background weighs more in "429 per
  CPU-second", and the added microseconds are the figure to compare.

The flood processes start (imports included, seconds on a busy machine) before the measured
window, which opens when all of them are ready. ``--py-spy PREFIX`` samples the gateway during
each flood (py-spy on PATH or in ``.cache/pyspy``) into ``PREFIX-off.txt`` / ``PREFIX-on.txt``,
collapsed stacks.

Run: ``.venv/bin/python -m bench.rejection_flood`` (``--access-log`` off/on compares the cost of
the per-request log lines). Prints a table and the load average before and after; asserts nothing.
On a loaded machine the figures move with the load: ``bench.rejection_replay`` compares checkouts
side by side, in process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import logging
import math
import multiprocessing
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import time
import timeit
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.admission_load import Result, chat_body, quantile, send
from bench.soak import free_port, process, wait_http

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "data" / "profiles" / "llama3-8b-h100-seqs4.yaml"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
HARDWARE = {"gpu": "H100-SXM", "model": "Llama-3-8B", "max_num_seqs": 4, "max_num_batched_tokens": 8192}
TARGET_PER_CPU_S = 5000.0
FLOOD_HEADERS = {"x-sluice-deadline-ms": "50"}
#: Seconds of admitted traffic alone, before the flood, that measure the gateway's background CPU.
BACKGROUND_S = 2.0


@dataclass(frozen=True)
class Figures:
    """One run's numbers."""

    label: str
    duration_s: float
    rejected: int
    gateway_cpu_s: float
    gateway_sys_s: float
    flood_sent: int
    flood_statuses: dict[int, int]
    admitted_ok: int
    admitted_failed: int
    admitted_ttft_p50_s: float
    #: The gateway's CPU seconds per wall second with the admitted traffic alone (just before the
    #: flood): scrapes, the admitted streams, timers.
    background_cpu_share: float = 0.0

    @property
    def rejected_per_s(self) -> float:
        return self.rejected / self.duration_s

    @property
    def cpu_share(self) -> float:
        return self.gateway_cpu_s / self.duration_s

    @property
    def rejected_per_cpu_s(self) -> float:
        return self.rejected / self.gateway_cpu_s if self.gateway_cpu_s > 0 else float("nan")

    @property
    def marginal_cpu_us(self) -> float:
        """Gateway CPU microseconds per rejection beyond the background (the CPU the flood added):
        the figure that stays comparable when a busy machine holds the flood's rate down."""
        added = self.gateway_cpu_s - self.background_cpu_share * self.duration_s
        return added / self.rejected * 1e6 if self.rejected > 0 else float("nan")


# -- processes ----------------------------------------------------------------------------------------
def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime + stime, stime) of ``pid`` from /proc, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, int(fields[12]) / ticks


def client_cores(gateway_core: int) -> set[int]:
    """The CPUs this process may use, less the gateway's (empty on a one-core machine)."""
    return set(os.sched_getaffinity(0)) - {gateway_core}


def _cpu_list(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


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
def flood_request(host: str, port: int) -> bytes:
    """The flood's one request, as bytes on the wire (HTTP/1.1, keep-alive)."""
    body = json.dumps(chat_body(MODEL, 40, 16, random.Random(0))).encode()
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in FLOOD_HEADERS.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _FloodConnection(asyncio.Protocol):
    """One keep-alive connection sending ``request`` back to back until ``end`` (monotonic s).

    A response is complete at its ``Content-Length`` (the gateway's errors) or, chunked (an
    admitted stream), at its last chunk. Status counts go to ``counts``; ``done`` resolves when
    the connection ends.
    """

    def __init__(
        self, request: bytes, end: float, counts: dict[str, int], done: asyncio.Future[None]
    ) -> None:
        self._request, self._end, self._counts, self._done = request, end, counts, done
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        while True:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(buf[:head_end]).lower()
            start = head_end + 4
            marker = head.find(b"\r\ncontent-length:")
            if marker >= 0:
                line_end = head.find(b"\r\n", marker + 2)
                length = int(head[marker + 17 : line_end if line_end >= 0 else len(head)])
                if len(buf) < start + length:
                    return
                end = start + length
            else:  # chunked: up to the terminating zero-length chunk
                last = buf.find(b"\r\n0\r\n\r\n", start - 2)
                if last < 0:
                    return
                end = last + 7
            status = head[9:12].decode()
            self._counts[status] = self._counts.get(status, 0) + 1
            del buf[:end]
            if time.monotonic() >= self._end:
                assert self._transport is not None
                self._transport.close()
                return
            assert self._transport is not None
            self._transport.write(self._request)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._buffer:
            self._counts["error"] = self._counts.get("error", 0) + 1
        if not self._done.done():
            self._done.set_result(None)


async def _flood(url: str, connections: int, duration_s: float) -> dict[str, int]:
    """``connections`` connections posting back to back until ``duration_s`` passes (a connection
    the gateway closes is opened again); status counts."""
    counts: dict[str, int] = {}
    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = flood_request(host, int(port))
    end = time.monotonic() + duration_s
    loop = asyncio.get_running_loop()

    async def connection() -> None:
        while time.monotonic() < end:
            done: asyncio.Future[None] = loop.create_future()
            try:
                await loop.create_connection(
                    functools.partial(_FloodConnection, request, end, counts, done), host, int(port)
                )
            except OSError:
                counts["error"] = counts.get("error", 0) + 1
                await asyncio.sleep(0.01)
                continue
            await done

    try:
        # A connection whose answer never comes must not hang the bench: counted as errors.
        await asyncio.wait_for(asyncio.gather(*(connection() for _ in range(connections))), duration_s + 30.0)
    except TimeoutError:
        counts["timeout"] = counts.get("timeout", 0) + 1
    return counts


def _flood_worker(url: str, connections: int, duration_s: float, out: Any, ready: Any, go: Any) -> None:
    """One flood process: says ``ready`` once imported, floods from ``go`` on (so that its start-up,
    seconds on a busy machine, is not inside the measured window), puts its counts on ``out``."""
    ready.put(os.getpid())
    go.wait()
    try:
        import uvloop  # the gateway's own event loop, when installed: the cheaper client
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        out.put(asyncio.run(_flood(url, connections, duration_s)))
        return
    out.put(uvloop.run(_flood(url, connections, duration_s)))


async def _admitted(url: str, until: list[float]) -> list[Result]:
    """Four closed-loop streaming clients (the replica's capacity), no deadline, until the
    monotonic time ``until[0]`` (set once the flood starts)."""
    rng = random.Random(1)
    results: list[Result] = []
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while time.monotonic() < until[0]:
                r = Result("admitted", time.monotonic())
                results.append(r)
                await send(session, url, chat_body(MODEL, 100, 64, rng), r)
                if r.status == 429:
                    await asyncio.sleep(float(r.headers.get("retry-after-ms", "100")) / 1000)

        await asyncio.gather(*(client() for _ in range(4)))
    return results


# -- one run ------------------------------------------------------------------------------------------
def run(
    *,
    duration_s: float,
    workers: int,
    connections: int,
    access_log: bool,
    core: int,
    py_spy: Path | None = None,
) -> Figures:
    """One run: the gateway pinned to ``core``, the emulator and every client to the other cores
    (this process's affinity is narrowed for good: the flood processes inherit it)."""
    others = client_cores(core)
    if others:
        os.sched_setaffinity(0, others)
    with tempfile.TemporaryDirectory(prefix="sluice-flood-") as tmp_dir:
        tmp = Path(tmp_dir)
        emu_port, gw_port = free_port(), free_port()
        emulator = [sys.executable, "-m", "simulator", "--profile", str(PROFILE), "--port", str(emu_port)]
        if others:
            emulator = ["taskset", "-c", _cpu_list(others), *emulator]
        config = {
            "server": {"port": gw_port},
            "replicas": [{"name": "emu", "url": f"http://127.0.0.1:{emu_port}", "hardware": HARDWARE}],
            "logging": {"access_log": access_log},
        }
        (tmp / "sluice.yaml").write_text(yaml.safe_dump(config))
        gateway = ["taskset", "-c", str(core), sys.executable, "-m", "gateway.cli", "serve"]
        gateway += ["--config", str(tmp / "sluice.yaml")]
        url = f"http://127.0.0.1:{gw_port}"
        with process(emulator, tmp / "emulator.log") as emu, process(gateway, tmp / "gateway.log") as gw:
            wait_http(f"http://127.0.0.1:{emu_port}/health", emu)
            wait_http(f"{url}/readyz", gw)
            time.sleep(2.0)  # a couple of scrapes: the step model has data
            label = "on" if access_log else "off"
            return _measure(url, gw.pid, duration_s, workers, connections, label, py_spy)


def _measure(
    url: str,
    pid: int,
    duration_s: float,
    workers: int,
    connections: int,
    label: str,
    py_spy: Path | None,
) -> Figures:
    ctx = multiprocessing.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    admitted_box: list[list[Result]] = []
    admitted_until = [math.inf]

    async def admitted_then_wait() -> None:
        admitted_box.append(await _admitted(url, admitted_until))

    async def all_ready() -> None:
        for _ in procs:
            while True:
                with contextlib.suppress(queue.Empty):
                    ready.get_nowait()
                    break
                await asyncio.sleep(0.05)

    procs = [
        ctx.Process(target=_flood_worker, args=(url, connections, duration_s, out, ready, go))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    runner = asyncio.new_event_loop()
    admitted_task = runner.create_task(admitted_then_wait())
    runner.run_until_complete(asyncio.sleep(1.0))  # admitted traffic fills the replica first
    runner.run_until_complete(asyncio.wait_for(all_ready(), 120.0))
    quiet_cpu, quiet_start = _cpu_seconds(pid)[0], time.monotonic()
    runner.run_until_complete(asyncio.sleep(BACKGROUND_S))
    background = (_cpu_seconds(pid)[0] - quiet_cpu) / (time.monotonic() - quiet_start)
    before_rejected, (before_cpu, before_sys), start = _rejected(url), _cpu_seconds(pid), time.monotonic()
    admitted_until[0] = start + duration_s + 2.0
    go.set()
    profiler = _py_spy(py_spy, pid, duration_s) if py_spy is not None else None
    counts: dict[str, int] = {}
    runner.run_until_complete(asyncio.sleep(duration_s))
    for _ in procs:
        for key, n in out.get(timeout=60).items():
            counts[key] = counts.get(key, 0) + n
    elapsed = time.monotonic() - start
    after_cpu, after_sys = _cpu_seconds(pid)
    rejected, cpu, kernel = _rejected(url) - before_rejected, after_cpu - before_cpu, after_sys - before_sys
    for p in procs:
        p.join(10)
    if profiler is not None:
        profiler.wait(60)
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
        gateway_sys_s=kernel,
        flood_sent=sum(counts.values()),
        flood_statuses={int(k): v for k, v in counts.items() if k.isdigit()},
        admitted_ok=len(ok),
        admitted_failed=len([r for r in admitted if r.status not in (200, 429) or r.error]),
        admitted_ttft_p50_s=quantile(ttft, 0.5),
        background_cpu_share=background,
    )


def _py_spy(out: Path, pid: int, duration_s: float) -> subprocess.Popen[bytes]:
    """py-spy sampling the gateway for the flood's first ``duration_s`` seconds (100 Hz,
    ``--nonblocking``: the gateway is never paused) into ``out`` (collapsed stacks, one a line)."""
    exe = shutil.which("py-spy") or str(ROOT / ".cache" / "pyspy" / "bin" / "py-spy")
    args = [exe, "record", "--nonblocking", "-r", "100", "-d", str(max(1, int(duration_s)))]
    args += ["-f", "raw", "-o", str(out), "-p", str(pid)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def table(rows: list[Figures]) -> str:
    head = (
        f"{'access log':>10} {'429/s':>8} {'gw CPU':>7} {'of it sys':>9} {'429/CPU-s':>10} "
        f"{'bg CPU':>6} {'us/429 added':>12} "
        f"{'flood sent':>10} {'admitted ok':>11} {'failed':>6} {'adm TTFT p50':>12}"
    )
    lines = [head, "-" * len(head)]
    for f in rows:
        sys_share = f.gateway_sys_s / f.gateway_cpu_s if f.gateway_cpu_s > 0 else float("nan")
        lines.append(
            f"{f.label:>10} {f.rejected_per_s:8.0f} {f.cpu_share:7.2f} {sys_share:9.0%} "
            f"{f.rejected_per_cpu_s:10.0f} {f.background_cpu_share:6.2f} {f.marginal_cpu_us:12.0f} "
            f"{f.flood_sent:10d} {f.admitted_ok:11d} {f.admitted_failed:6d} "
            f"{f.admitted_ttft_p50_s * 1e3:10.1f} ms"
        )
    lines.append(f"target: >= {TARGET_PER_CPU_S:.0f} rejections per CPU-second of the gateway (one core)")
    lines.append(
        "bg CPU: the gateway's CPU share with the admitted traffic alone; us/429 added: its CPU "
        "beyond that, per rejection"
    )
    return "\n".join(lines)


# -- the rejection path's pieces, in process --------------------------------------------------------
def _cpu_us(fn: Callable[[], object], number: int = 20_000, repeat: int = 7) -> float:
    """``fn``'s CPU cost, microseconds: the least of ``repeat`` timings of ``number`` calls
    (thread CPU time, so a busy machine's waits do not count)."""
    return min(timeit.Timer(fn, timer=time.thread_time).repeat(number=number, repeat=repeat)) / number * 1e6


def pieces() -> list[tuple[str, float, float]]:
    """(piece, the generic way's CPU us, Sluice's CPU us) for the per-request pieces of a 429 that
    have a cheaper form in the gateway: the request id, the error body and response, the access line
    (through ``Logger.info`` and the stock ``formatTime`` against ``log_access`` with
    ``configure_logging``'s handler, which formats it without a record; both to memory).
    (The body parse's fast path saves the schema's validation, about 3 us: not a piece to time
    apart from the parse.)"""
    from gateway.admission.retry_after import RetryAfter
    from gateway.config.settings import LoggingSettings
    from gateway.http.errors import AdmissionRejected, error_response
    from gateway.observability.log_format import TextFormatter
    from gateway.observability.logs import configure_logging, log_access, new_request_id
    from gateway.observability.outcome import RequestOutcome, access_fields

    err = AdmissionRejected(
        "first token predicted 0.234 s after the client's deadline (best replica emu)",
        reason="deadline_exceeded",
        retry_after=RetryAfter(delay_s=0.734, seconds=1, milliseconds=734, base_s=0.5),
    )
    outcome = RequestOutcome(new_request_id(), "POST", "/v1/chat/completions", 1.0, model=MODEL, stream=True)
    outcome.status, outcome.error, outcome.request_class = 429, "deadline_exceeded", "interactive"
    outcome.decision, outcome.reason, outcome.queue_wait_s = "rejected", "deadline_exceeded", 0.0
    outcome.retry_after_s, outcome.predicted_ttft_s, outcome.finished_at = 0.734, 0.3, 1.001
    rows = [
        ("request id", _cpu_us(lambda: uuid.uuid4().hex), _cpu_us(new_request_id)),
        ("error body", _cpu_us(lambda: json.dumps(err.body()).encode()), _cpu_us(err.body_bytes)),
    ]
    stock = web.Response  # the generic response: the body dumped by json.dumps
    rows.append(
        (
            "error response",
            _cpu_us(
                lambda: stock(
                    status=429,
                    body=json.dumps(err.body()).encode(),
                    content_type="application/json",
                    headers=err.headers(),
                )
            ),
            _cpu_us(lambda: error_response(err)),
        )
    )
    logger = logging.getLogger("sluice.access")
    with io.StringIO() as sink:  # the write itself is the same either way
        handler = logging.StreamHandler(sink)
        formatter = TextFormatter()
        handler.setFormatter(formatter)
        logger.addHandler(handler)
        saved = logger.propagate, logger.level
        logger.propagate, logger.level = False, logging.INFO
        try:
            formatter.formatTime = functools.partial(logging.Formatter.formatTime, formatter)  # type: ignore[method-assign]
            generic = _cpu_us(
                lambda: logger.info("access", extra={"fields": access_fields(outcome)}), number=5_000
            )
        finally:
            logger.removeHandler(handler)
            logger.propagate, logger.level = saved
        # Sluice's: configure_logging's handler alone on the root, as in ``sluice serve`` (no event
        # loop here, so each line is written at once: the buffering's saving is not in the figure).
        root = logging.getLogger()
        before, level = list(root.handlers), root.level
        for other in before:
            root.removeHandler(other)
        try:
            configure_logging(LoggingSettings(), stream=sink)
            rows.append(("access line (text)", generic, _cpu_us(lambda: log_access(outcome), number=5_000)))
        finally:
            for ours in list(root.handlers):
                root.removeHandler(ours)
            for other in before:
                root.addHandler(other)
            root.setLevel(level)
    return rows


def pieces_table(rows: list[tuple[str, float, float]]) -> str:
    head = f"{'piece of a 429':<32} {'generic us':>10} {'Sluice us':>9}"
    lines = [head, "-" * len(head)]
    lines += [f"{name:<32} {generic:10.2f} {ours:9.2f}" for name, generic, ours in rows]
    lines.append(f"{'sum':<32} {sum(r[1] for r in rows):10.2f} {sum(r[2] for r in rows):9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of flood per run")
    parser.add_argument("--workers", type=int, default=2, help="flood client processes")
    parser.add_argument("--connections", type=int, default=64, help="connections per flood process")
    parser.add_argument("--core", type=int, default=0, help="CPU the gateway is pinned to")
    parser.add_argument("--access-log", choices=["on", "off", "both"], default="both")
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="PREFIX",
        help="profile the gateway during each flood with py-spy into PREFIX-<access log>.txt (collapsed "
        "stacks; py-spy on PATH or in .cache/pyspy)",
    )
    parser.add_argument(
        "--pieces",
        action="store_true",
        help="only time, in this process, the pieces of a 429 that have a cheaper form in the gateway "
        "(generic against Sluice's, CPU microseconds)",
    )
    args = parser.parse_args(argv)
    if args.pieces:
        print(pieces_table(pieces()))
        return
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.access_log]
    others = client_cores(args.core)
    if others:
        print(
            f"gateway pinned to core {args.core} (taskset); emulator and clients pinned to core(s) "
            f"{_cpu_list(others)}"
        )
    else:
        print(f"one core only: the gateway (core {args.core}) shares it with the emulator and the clients")
    load_before = os.getloadavg()
    rows = [
        run(
            duration_s=args.duration,
            workers=args.workers,
            connections=args.connections,
            access_log=mode,
            core=args.core,
            py_spy=None if args.py_spy is None else Path(f"{args.py_spy}-{'on' if mode else 'off'}.txt"),
        )
        for mode in modes
    ]
    print(table(rows))
    for f in rows:
        print(f"access log {f.label}: flood statuses {f.flood_statuses}")
    load_after = os.getloadavg()
    # The figures are CPU per rejection on a shared core: compare runs only at a like load.
    before, after = (" ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    print(f"load average (1, 5, 15 min) before: {before}; after: {after} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
