"""Where one request's wall-clock time goes inside Sluice at concurrency 1 (the "+p50 at c=1" target).

At concurrency 1 the latency Sluice adds is its serial path, not its throughput: every await on
the way from the request's bytes arriving to the response's bytes leaving counts in full. This
tool starts the overhead bench's fake backend, a ``redis-server`` and ``sluice serve`` (the
bench's ``sluice`` or ``sluice-lean`` configuration) with ``time.perf_counter`` stamps patched
around each stage of the request path, drives it with the bench's closed-loop client at
concurrency 1 (JSON, not streamed), and prints, per stage, the median time from the request's
first byte arriving at Sluice (``rx``), in microseconds.

The stamps are taken by wrapping functions from outside (nothing in ``gateway/`` is edited), so
the same tool runs against another checkout (``--tree``) for a before/after comparison. Wrapping
costs a few microseconds per stamp; compare trees with the same stamps, not absolute times.

Run: ``.venv/bin/python -m bench.overhead.timeline [--only bare,sluice-lean,sluice] [--rounds 2]
[--duration 3] [--tree base=DIR --only sluice,sluice@base,...]``: each configuration is taken in turn
(reversed every other round) with the backend measured directly in each round too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: (label, perf_counter seconds, this thread's CPU seconds) in arrival order; one process, one
#: request at a time.
EVENTS: list[tuple[str, float, float]] = []
#: True while a proxied request is between ``Proxy._send`` and its end: upstream bytes received
#: then are this request's (health checks and scrapes use the same client session).
_IN_REQUEST = [False]


def _stamp(label: str) -> None:
    EVENTS.append((label, time.perf_counter(), time.thread_time()))


def _wrap_async(owner: Any, name: str, label: str, *, mark: Callable[[bool], None] | None = None) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stamp(label + " >")
        try:
            return await original(*args, **kwargs)
        finally:
            _stamp(label + " <")

    setattr(owner, name, wrapper)


def _wrap_sync(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stamp(label + " >")
        try:
            return original(*args, **kwargs)
        finally:
            _stamp(label + " <")

    setattr(owner, name, wrapper)


def _install_aiohttp() -> None:
    """Stamp the bytes in and out of the server and the client (any aiohttp proxy)."""
    from aiohttp import client_proto, http_writer, web_protocol

    server_rx = web_protocol.RequestHandler.data_received

    def rx(self: Any, data: bytes) -> None:
        _stamp("rx")
        server_rx(self, data)

    web_protocol.RequestHandler.data_received = rx  # type: ignore[method-assign]
    client_rx = client_proto.ResponseHandler.data_received

    def up_rx(self: Any, data: bytes) -> None:
        if _IN_REQUEST[0]:
            _stamp("upstream rx")
        client_rx(self, data)

    client_proto.ResponseHandler.data_received = up_rx  # type: ignore[method-assign]
    write = http_writer.StreamWriter._write

    def tx(self: Any, chunk: Any) -> None:
        side = "tx to client" if isinstance(self._protocol, web_protocol.RequestHandler) else "tx upstream"
        if side == "tx to client" or _IN_REQUEST[0]:
            _stamp(side)
        write(self, chunk)

    http_writer.StreamWriter._write = tx  # type: ignore[method-assign]
    writelines = http_writer.StreamWriter._writelines

    def txl(self: Any, chunks: Any) -> None:
        side = "tx to client" if isinstance(self._protocol, web_protocol.RequestHandler) else "tx upstream"
        if side == "tx to client" or _IN_REQUEST[0]:
            _stamp(side)
        writelines(self, chunks)

    http_writer.StreamWriter._writelines = txl  # type: ignore[method-assign]
    _wrap_async(web_protocol.RequestHandler, "_handle_request", "aiohttp _handle_request")
    _wrap_async(web_protocol.RequestHandler, "finish_response", "aiohttp finish_response")


def _install() -> None:
    """Patch the stamps in (the serving child only)."""
    import aiohttp

    import gateway.admission.live as admission_live
    import gateway.admission.live_budget as live_budget
    import gateway.app
    import gateway.observability.logs as logs
    import gateway.proxy.forward as proxy
    import gateway.proxy.relay as relay_module
    import gateway.tenants.live as tenancy
    from gateway.admission.live import LiveAdmission

    _install_aiohttp()
    _wrap_async(aiohttp.ClientSession, "_request", "ClientSession._request")
    _wrap_async(aiohttp.BaseConnector, "connect", "connector.connect")
    _wrap_async(aiohttp.ClientRequest, "send", "ClientRequest.send")
    _wrap_sync(proxy, "forwarded", "forwarded (headers)")
    _wrap_async(proxy, "encode_upstream_body", "encode_upstream_body")
    _wrap_async(proxy.Proxy, "handle", "Proxy.handle")
    _wrap_async(proxy.Proxy, "_forward", "Proxy._forward")
    _wrap_async(proxy.Proxy, "_exchange", "Proxy._exchange (task)")

    send = proxy.Proxy._send

    async def send_marked(self: Any, ex: Any) -> Any:
        _IN_REQUEST[0] = True
        _stamp("Proxy._send >")
        try:
            return await send(self, ex)
        finally:
            _stamp("Proxy._send <")

    proxy.Proxy._send = send_marked  # type: ignore[method-assign]
    _wrap_async(relay_module.Relay, "read_upstream", "Relay.read_upstream")
    relay = relay_module.Relay.relay_body

    async def relay_marked(self: Any, ex: Any, upstream: Any) -> Any:
        _stamp("Relay.relay_body >")
        try:
            return await relay(self, ex, upstream)
        finally:
            _IN_REQUEST[0] = False
            _stamp("Relay.relay_body <")

    relay_module.Relay.relay_body = relay_marked  # type: ignore[method-assign]
    _wrap_sync(proxy.Proxy, "_notify", "Proxy._notify (outcome listeners)")
    _wrap_async(proxy, "read_request", "read_request (proxy)")
    _wrap_async(live_budget.LiveBudget, "fetch", "LiveBudget.fetch")
    _wrap_sync(live_budget.LiveBudget, "settle", "LiveBudget.settle")
    _wrap_async(LiveAdmission, "admit", "LiveAdmission.admit")
    _wrap_sync(logs, "log_access", "log_access")
    _wrap_sync(tenancy.Tenancy, "_authenticate", "Tenancy._authenticate")
    _wrap_sync(tenancy.Tenancy, "weights", "Tenancy.weights")
    _wrap_async(admission_live, "prompt_size", "prompt_size")
    _wrap_sync(live_budget, "new_request_id", "new_request_id")
    _wrap_sync(proxy.Proxy, "_with_overhead", "Proxy._with_overhead")
    _wrap_async(aiohttp.ClientResponse, "start", "ClientResponse.start")
    import gateway.limits.pipelined as pipelined
    import gateway.limits.redis as redis_limiter

    _wrap_async(redis_limiter.RedisLimiter, "_call", "RedisLimiter._call")
    _wrap_async(pipelined.PipelinedScripts, "_call", "PipelinedScripts._call")
    _wrap_sync(redis_limiter, "_reservation", "redis _reservation")
    start = tenancy.Tenancy.start

    def start_wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        start(self, *args, **kwargs)
        limiter = self._limiter
        _wrap_async(limiter, "reserve", "limiter.reserve")
        _wrap_async(limiter, "settle", "limiter.settle")

    tenancy.Tenancy.start = start_wrapped  # type: ignore[method-assign]
    build = gateway.app.build_app

    def build_wrapped(*args: Any, **kwargs: Any) -> Any:
        app = build(*args, **kwargs)
        for i, middleware in enumerate(list(app.middlewares)):
            label = f"mw{i} {getattr(middleware, '__qualname__', middleware)}"
            app.middlewares[i] = _middleware(middleware, label)
        return app

    gateway.app.build_app = build_wrapped


def _middleware(middleware: Any, label: str) -> Any:
    from aiohttp import web

    @web.middleware
    async def wrapper(request: Any, handler: Any) -> Any:
        _stamp(label + " >")
        try:
            return await middleware(request, handler)
        finally:
            _stamp(label + " <")

    return wrapper


def serve(config: Path, out: Path) -> int:
    """The child: ``sluice serve --config config`` with the stamps; events to ``out`` at exit."""
    _install()
    from gateway.cli import main

    try:
        return main(["serve", "--config", str(config)])
    finally:
        out.write_text(json.dumps(EVENTS))


def serve_bare(port: int, upstream: str, out: Path) -> int:
    """The child for ``--bare``: ``bench.overhead.bare`` with the aiohttp stamps."""
    import signal

    _install_aiohttp()
    _IN_REQUEST[0] = True  # the bare proxy makes no other upstream calls
    from bench.overhead import bare

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        bare.main(["--port", str(port), "--upstream", upstream])
    finally:
        out.write_text(json.dumps(EVENTS))
    return 0


# -- the driver ---------------------------------------------------------------------------------------
Event = tuple[str, float, float]


def requests_of(events: list[Event]) -> list[list[Event]]:
    """Split the event log into requests: each starts at an ``rx`` that follows a ``tx to client``."""
    out: list[list[Event]] = []
    current: list[Event] | None = None
    answered = True
    for label, t, cpu in events:
        if label == "rx" and answered:
            current = []
            out.append(current)
            answered = False
        if current is None:
            continue
        if label == "tx to client":
            answered = True
        current.append((label, t, cpu))
    return out


Row = tuple[str, float, float, float, int]


def timeline(requests: list[list[Event]]) -> list[Row]:
    """(label, median wall offset from rx in us, p90 of it, median CPU offset from rx in us,
    requests that had it) for each label's first occurrence per request (and the last of the
    byte stamps), in order of the median wall offset."""
    offsets: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for req in requests:
        if not req:
            continue
        _, t0, c0 = req[0]
        seen: dict[str, tuple[float, float]] = {}
        last: dict[str, tuple[float, float]] = {}
        for label, t, cpu in req:
            seen.setdefault(label, (t, cpu))
            last[label] = (t, cpu)
        for label in ("tx to client", "upstream rx", "tx upstream"):
            if label in last and last[label] != seen[label]:
                seen[label + " (last)"] = last[label]
        for label, (t, cpu) in seen.items():
            offsets.setdefault(label, []).append((t - t0) * 1e6)
            cpus.setdefault(label, []).append((cpu - c0) * 1e6)
    gaps: list[float] = []
    gap_cpus: list[float] = []
    for before, after in itertools.pairwise(requests):
        sent = [(t, cpu) for label, t, cpu in before if label == "tx to client"]
        if sent and after:
            gaps.append((after[0][1] - sent[-1][0]) * 1e6)
            gap_cpus.append((after[0][2] - sent[-1][1]) * 1e6)
    if gaps:
        offsets["(gap: last tx to client -> next request's rx)"] = gaps
        cpus["(gap: last tx to client -> next request's rx)"] = gap_cpus
    rows = []
    for label, values in offsets.items():
        values.sort()
        p90 = values[int(0.9 * (len(values) - 1))]
        rows.append((label, statistics.median(values), p90, statistics.median(cpus[label]), len(values)))
    rows.sort(key=lambda r: (r[0].startswith("(gap"), r[1]))
    return rows


@dataclass
class _Child:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    out: Path
    log: Path
    latencies_s: list[float]


def _start_child(name: str, work: Path, layout: Any, tree: Path | None) -> _Child:
    """``name``: ``bare``, ``sluice`` or ``sluice-lean`` (from ``tree`` when given)."""
    import yaml

    from bench.overhead import peers
    from tests.support.procs import free_port

    port = free_port()
    out = work / f"{name}.events.json"
    log = work / f"{name}.log"
    env = {"PYTHONPATH": os.pathsep.join(str(p) for p in ([tree] if tree else []) + [ROOT])}
    if name == "bare":
        cmd = [sys.executable, str(Path(__file__)), "serve-bare", "--port", str(port)]
        cmd += ["--upstream", layout.backend_url, "--out", str(out)]
        ready = "/health"
    else:
        config = work / f"{name}.yaml"
        kind = name.split("@", 1)[0]
        config.write_text(yaml.safe_dump(peers.sluice_config(layout, port, lean=kind == "sluice-lean")))
        cmd = [sys.executable, str(Path(__file__)), "serve", "--config", str(config), "--out", str(out)]
        ready = "/readyz"
    proc = peers.start(peers.pinned(layout.proxy_cpus, cmd), log, env=env, cwd=tree or ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        peers.wait_ready(url + ready, proc, log)
    except peers.Unavailable:
        peers.stop(proc)
        raise
    return _Child(name, url, proc, out, log, [])


def drive(
    names: list[str], rounds: int, duration_s: float, trees: dict[str, Path], spy_s: float = 0.0
) -> dict[str, Any]:
    """Backend + Redis + each configuration stamped, taken in turn (reversed every other round)
    under one c=1 JSON load of ``duration_s`` per round; a name ``kind@label`` runs ``kind`` from
    ``trees[label]``. Returns, per name, the client's latency and the timeline."""
    from bench.overhead import core, peers
    from bench.overhead.load import closed_loop
    from tests.support.procs import free_port
    from tests.support.redis import redis_server

    proxy_cpus, load_cpus, _ = core.cpu_layout(None)
    own_affinity = os.sched_getaffinity(0)
    report: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="sluice-timeline-") as tmp,
        redis_server(name="redis-timeline") as redis,
        contextlib.ExitStack() as stack,
    ):
        work = Path(tmp)
        peers.pin_all_threads(redis.pid, load_cpus)
        port = free_port()
        backend_log = work / "backend.log"
        args = [sys.executable, "-m", "bench.overhead.backend", "--port", str(port)]
        backend = peers.start(peers.pinned(load_cpus, args), backend_log)
        stack.callback(peers.stop, backend)
        backend_url = f"http://127.0.0.1:{port}"
        peers.wait_ready(backend_url + "/health", backend, backend_log)
        layout = peers.Layout(proxy_cpus, load_cpus, work, backend_url, redis.url, redis.port)
        children = []
        for name in names:
            label = name.split("@", 1)[1] if "@" in name else None
            child = _start_child(name, work, layout, trees[label] if label else None)
            stack.callback(peers.stop, child.proc)
            children.append(child)
        headers = {"Authorization": f"Bearer {peers.API_KEY}"}
        body = core.body(False, 16)
        direct: list[float] = []
        if load_cpus:
            os.sched_setaffinity(0, {int(c) for c in load_cpus.split(",")})
        try:
            for round_ in range(rounds):
                order = children if round_ % 2 == 0 else children[::-1]
                for url, sink in [(backend_url, direct)] + [(c.url, c.latencies_s) for c in order]:
                    result = asyncio.run(
                        closed_loop(
                            url + "/v1/chat/completions",
                            body,
                            headers,
                            concurrency=1,
                            duration_s=duration_s,
                            warmup_s=0.3,
                        )
                    )
                    sink += result.latencies_s
            if spy_s > 0:
                report["spy"] = _spy(layout, spy_s, body, headers, work)
        finally:
            os.sched_setaffinity(0, own_affinity)
        report["direct"] = {"client_p50_ms": statistics.median(direct) * 1e3, "n": len(direct)}
        for child in children:
            peers.stop(child.proc)
            events = [(str(a), float(b), float(c)) for a, b, c in json.loads(child.out.read_text())]
            requests = [r for r in requests_of(events) if any(e[0] == "tx to client" for e in r)]
            # The readiness probes and the backend's own GETs are not chat completions.
            requests = [r for r in requests if any(e[0] in ("tx upstream",) for e in r)]
            ordered = sorted(child.latencies_s)
            report[child.name] = {
                "client_p10_ms": ordered[len(ordered) // 10] * 1e3,
                "client_p25_ms": ordered[len(ordered) // 4] * 1e3,
                "client_p50_ms": statistics.median(child.latencies_s) * 1e3,
                "n": len(child.latencies_s),
                "rows": timeline(requests),
            }
    return report


def _spy(layout: Any, seconds: float, body: dict[str, Any], headers: dict[str, str], work: Path) -> str:
    """py-spy (``--gil``, 1 kHz) on an unstamped ``sluice`` (everything on) under c=1 JSON load."""
    import time as _time

    from bench.overhead import peers
    from bench.overhead.core import profile_text
    from bench.overhead.load import closed_loop
    from bench.overhead.profile import record, summarise

    target = peers.start_sluice(layout)
    try:
        assert target.pid is not None
        asyncio.run(
            closed_loop(target.url + "/v1/chat/completions", body, headers, concurrency=1, duration_s=1.0)
        )
        raw = work / "spy.txt"
        spy = record(target.pid, seconds, raw, layout.load_cpus, rate_hz=1000)
        _time.sleep(0.5)
        asyncio.run(
            closed_loop(
                target.url + "/v1/chat/completions", body, headers, concurrency=1, duration_s=seconds + 1
            )
        )
        spy.communicate(timeout=60)
        return "\n".join(profile_text("sluice json c=1", summarise(raw.read_text()), top=30))
    finally:
        peers.stop(target.proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    child = sub.add_parser("serve", help="(internal) the stamped sluice serve")
    child.add_argument("--config", type=Path, required=True)
    child.add_argument("--out", type=Path, required=True)
    bare_child = sub.add_parser("serve-bare", help="(internal) the stamped bare proxy")
    bare_child.add_argument("--port", type=int, required=True)
    bare_child.add_argument("--upstream", required=True)
    bare_child.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--only",
        default="bare,sluice-lean,sluice",
        help="configurations: bare, sluice-lean, sluice; KIND@LABEL runs KIND from --tree LABEL=DIR",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of c=1 load per round")
    parser.add_argument(
        "--tree", action="append", default=[], help="LABEL=DIR: a checkout KIND@LABEL runs from (repeatable)"
    )
    parser.add_argument("--spy", type=float, default=0.0, help="also py-spy an unstamped sluice this long")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        return serve(args.config, args.out)
    if args.cmd == "serve-bare":
        return serve_bare(args.port, args.upstream, args.out)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    trees = {label: Path(path).resolve() for label, _, path in (t.partition("=") for t in args.tree)}
    missing = {n.split("@", 1)[1] for n in names if "@" in n} - set(trees)
    if missing:
        parser.error(f"no --tree for {', '.join(sorted(missing))}")
    report = drive(names, args.rounds, args.duration, trees, args.spy)
    direct = report.pop("direct")
    spy = report.pop("spy", None)
    print(f"direct: client p50 {direct['client_p50_ms']:.3f} ms ({direct['n']} requests)")
    for name, r in report.items():
        added = r["client_p50_ms"] - direct["client_p50_ms"]
        print(
            f"\n{name}: client p10 {r['client_p10_ms']:.3f} ms, p25 {r['client_p25_ms']:.3f} ms, "
            f"p50 {r['client_p50_ms']:.3f} ms (+{added:.3f} ms over direct), "
            f"{r['n']} requests"
        )
        print(
            f"  {'stage (> enter, < leave)':<50} {'wall p50 us':>11} {'p90':>7} {'CPU p50 us':>10} {'n':>6}"
        )
        for label, p50, p90, cpu, n in r["rows"]:
            print(f"  {label:<50} {p50:11.0f} {p90:7.0f} {cpu:10.0f} {n:6d}")
    if spy:
        print("\n" + spy)
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    raise SystemExit(main())
