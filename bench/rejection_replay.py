"""The CPU one 429 costs inside the gateway's request handling, in process (``bench.rejection_flood``'s
companion for a busy machine).

The real application (``gateway.app.build_app``, on uvloop) serves on a port; one emulated
replica (``bench.rejection_flood``'s profile: 4 sequences) is kept full by the 4 closed-loop
admitted streaming clients of ``bench.rejection_flood``, in another process pinned to the other
core. Then the flood's request (its 50 ms deadline cannot be met) is fed to aiohttp's own
protocol through an in-memory transport, one at a time, ``--requests`` per round for
``--rounds`` rounds: no client, no socket. For each 429 the thread CPU of
``Application._handle`` (routing, middlewares, the body, admission, the error response, the
outcome listeners) plus ``RequestHandler.finish_response`` (preparing and writing it) is taken;
aiohttp's parsing and the event loop are not in it.

Thread CPU counts only the time the gateway ran, but on a loaded machine other processes evict its
caches, so one run's figures move with the load. Two trees compare best run **at the same time on
the same core** (each ``--tree`` is the checkout whose ``gateway`` package is measured)::

    for t in /tmp/base /work/main; do .venv/bin/python -m bench.rejection_replay --tree $t & done; wait

``--access-log`` turns the access log on (text lines to a temporary file, as ``sluice serve``
writes them to a redirected stderr); its write may fall outside ``_handle`` and
``finish_response`` (a buffered handler writes at the end of the loop's iteration), so the
output adds the event loop thread's whole CPU per 429 over the rounds: parsing, the loop, the
writes, and the admitted streams' share (the same for two trees run side by side).

Prints the 10th, 25th and 50th percentiles (microseconds per 429), the thread's CPU per 429 over
the rounds, and the load average; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


#: The admitted streams of ``bench.rejection_flood`` for an hour (a child process, killed after).
_ADMITTED = (
    "import sys, time, uvloop; from bench.rejection_flood import _admitted; "
    "uvloop.run(_admitted(sys.argv[1], [time.monotonic() + 3600.0]))"
)


class MemoryTransport(asyncio.Transport):
    """The server side of one keep-alive connection, in memory: counts complete responses by
    status (by ``Content-Length``, or a chunked body's last chunk) and wakes ``waiter``."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = bytearray()
        self._closing = False
        self.waiter: asyncio.Future[None] | None = None
        self.statuses: dict[str, int] = {}

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 80)}.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer += data
        self._complete()

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self._buffer += chunk
        self._complete()

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16384, 65536)

    def _complete(self) -> None:
        buf = self._buffer
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = bytes(buf[:head_end]).lower()
        marker = head.find(b"\r\ncontent-length:")
        if marker < 0:
            last = buf.find(b"\r\n0\r\n\r\n", head_end)
            if last < 0:
                return
            stop = last + 7
        else:
            line_end = head.find(b"\r\n", marker + 2)
            length = int(head[marker + 17 : line_end if line_end >= 0 else len(head)])
            if len(buf) < head_end + 4 + length:
                return
            stop = head_end + 4 + length
        status = head[9:12].decode()
        self.statuses[status] = self.statuses.get(status, 0) + 1
        del buf[:stop]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _timed(samples: list[float], active: list[bool]) -> None:
    """Wrap aiohttp's ``Application._handle`` and ``RequestHandler.finish_response`` so that each
    429's thread CPU in both goes to ``samples`` (seconds) while ``active[0]``."""
    from aiohttp import web_app, web_protocol

    handle = web_app.Application._handle
    finish = web_protocol.RequestHandler.finish_response

    async def timed_handle(self: web_app.Application, request: Any) -> Any:
        start = time.thread_time()
        response = await handle(self, request)
        request["bench_handle_s"] = time.thread_time() - start
        return response

    async def timed_finish(self: Any, request: Any, response: Any, at: float | None) -> Any:
        start = time.thread_time()
        result = await finish(self, request, response, at)
        if response.status == 429 and active[0]:
            samples.append(request.get("bench_handle_s", 0.0) + time.thread_time() - start)
        return result

    web_app.Application._handle = timed_handle  # type: ignore[method-assign]
    web_protocol.RequestHandler.finish_response = timed_finish  # type: ignore[method-assign,assignment]


async def replay(
    requests: int, rounds: int, warm_s: float, emu_port: int, tree: Path, *, access_log: bool = False
) -> tuple[list[float], float]:
    """Per-429 thread CPU seconds of ``rounds`` x ``requests`` flood requests (see the module),
    against the emulator on ``emu_port``, and the loop thread's CPU seconds over those rounds;
    the admitted clients run from ``tree``. ``access_log``: the access lines on, to a file."""
    from aiohttp import web

    from bench.rejection_flood import HARDWARE, flood_request
    from bench.soak import free_port
    from gateway.app import build_app
    from gateway.config.load import load_settings
    from gateway.config.store import SettingsStore
    from gateway.observability.logs import configure_logging

    samples: list[float] = []
    active = [False]
    _timed(samples, active)
    gw_port = free_port()
    replica = {"name": "emu", "url": f"http://127.0.0.1:{emu_port}", "hardware": HARDWARE}
    stderr = sys.stderr
    with tempfile.TemporaryDirectory(prefix="sluice-replay-") as tmp:
        config = Path(tmp) / "sluice.yaml"
        config.write_text(
            yaml.safe_dump(
                {"server": {"port": gw_port}, "replicas": [replica], "logging": {"access_log": access_log}}
            )
        )
        settings = load_settings(config)
        if access_log:
            # The gateway's stderr redirected to a file: line buffered, as Python makes it.
            log_file = Path(tmp) / "gateway.log"
            sys.stderr = open(log_file, "w", buffering=1)  # noqa: ASYNC230, SIM115 - set-up; closed below
            configure_logging(settings.logging)
        runner = web.AppRunner(build_app(SettingsStore(settings)), access_log=None)
        admitted: subprocess.Popen[bytes] | None = None
        round_cpu_s = 0.0
        try:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", gw_port).start()
            cpus = ",".join(str(c) for c in sorted(_others()))
            admitted = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is timed
                ["taskset", "-c", cpus, sys.executable, "-c", _ADMITTED, f"http://127.0.0.1:{gw_port}"],
                cwd=tree,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await asyncio.sleep(warm_s)  # the replica fills, scrapes fit its step model
            request = flood_request("127.0.0.1", gw_port)
            server = runner.server
            assert server is not None
            await _burst(server, request, 200)  # warm caches and memos outside the samples
            active[0] = True
            for _ in range(rounds):
                start = time.thread_time()
                await _burst(server, request, requests)
                await asyncio.sleep(0)  # what the last request left for the loop's next iteration
                round_cpu_s += time.thread_time() - start
        finally:
            if admitted is not None:
                admitted.terminate()
                admitted.wait(15)
            await runner.cleanup()
            if sys.stderr is not stderr:
                root = logging.getLogger()
                for handler in list(root.handlers):
                    handler.flush()
                    root.removeHandler(handler)
                sys.stderr.close()
                sys.stderr = stderr
    return samples, round_cpu_s


def _others() -> set[int]:
    """The CPUs other than 0 (the gateway's), or 0 alone on a one-core machine."""
    return set(os.sched_getaffinity(0)) - {0} or {0}


async def _burst(server: Callable[[], asyncio.Protocol], request: bytes, count: int) -> dict[str, int]:
    """``count`` requests, one after another, on one in-memory connection; statuses counted."""
    transport = MemoryTransport()
    protocol = server()
    protocol.connection_made(transport)
    loop = asyncio.get_running_loop()
    for _ in range(count):
        transport.waiter = loop.create_future()
        protocol.data_received(request)
        await _wait(transport.waiter)
    transport.close()
    protocol.connection_lost(None)
    return transport.statuses


async def _wait(answer: Awaitable[None]) -> None:
    await asyncio.wait_for(answer, 60.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="checkout whose gateway is measured")
    parser.add_argument("--requests", type=int, default=1500, help="flood requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=float, default=4.0, help="seconds of admitted traffic first")
    parser.add_argument("--access-log", action="store_true", help="access lines on (to a file)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.tree.resolve()))
    for name in [m for m in sys.modules if m in ("gateway", "bench") or m.startswith(("gateway.", "bench."))]:
        if name != __name__:
            del sys.modules[name]
    import uvloop

    from bench.rejection_flood import PROFILE
    from bench.soak import free_port, process, wait_http

    emu_port = free_port()
    cpus = ",".join(str(c) for c in sorted(_others()))
    emulator = ["taskset", "-c", cpus, sys.executable, "-m", "simulator", "--profile", str(PROFILE)]
    with (
        tempfile.TemporaryDirectory(prefix="sluice-replay-") as tmp,
        process([*emulator, "--port", str(emu_port)], Path(tmp) / "emulator.log") as emu,
    ):
        wait_http(f"http://127.0.0.1:{emu_port}/health", emu)
        if 0 in os.sched_getaffinity(0):
            os.sched_setaffinity(0, {0})
        found, round_cpu_s = uvloop.run(
            replay(
                args.requests,
                args.rounds,
                args.warm,
                emu_port,
                args.tree.resolve(),
                access_log=args.access_log,
            )
        )
        samples = sorted(found)
    if not samples:
        print("no 429 was answered: is the replica full?")
        return

    def pct(q: float) -> float:
        return samples[int(q * (len(samples) - 1))] * 1e6

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    access = "on" if args.access_log else "off"
    print(
        f"tree {args.tree} (access log {access}): {len(samples)} rejections, handle + finish thread CPU "
        f"per 429: p10 {pct(0.1):.1f} us, p25 {pct(0.25):.1f} us, median {pct(0.5):.1f} us; loop thread "
        f"{round_cpu_s / len(samples) * 1e6:.1f} us per 429 over the rounds; load average {load}"
    )


if __name__ == "__main__":
    main()
