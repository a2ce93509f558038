"""Slowloris against ``sluice serve``: when does the gateway cut a connection that dribbles?

Starts one emulated replica and ``sluice serve`` (server settings at their defaults), then opens
three raw connections at once and watches each for up to ``--watch-s`` seconds:

* **idle**: connects and sends nothing;
* **header dribbler**: sends a request's headers one byte per second, never finishing them;
* **body dribbler**: sends complete headers announcing a 100,000-byte body, then one byte per
  second of it.

Prints, per connection, what the gateway answered and when, after how many seconds it closed the
connection (EOF or reset), or that it was still open at the end. Expected at the defaults: idle
and header dribbler closed at 75 s (aiohttp's keep-alive timer), body dribbler answered 408
(``request_timeout``) at 30 s (``server.client_read_timeout_s``) and closed at most 10 s later
(aiohttp's lingering close, which reads and drops what the client still sends so that it can
read the answer). Asserts nothing: the results are in docs/operations.md ("Floods and slow
clients").

Run: ``.venv/bin/python -m bench.slowloris`` (about 2 minutes). ``--quick`` (about 10 s, for CI)
is the same three connections against a gateway whose ``server.client_read_timeout_s`` is
``QUICK_READ_TIMEOUT_S``, watched for ``QUICK_WATCH_S`` seconds: the body dribbler is then
answered 408 within the watch (the lingering close keeps its connection open past the end), while
the idle connection and the header dribbler (aiohttp's 75 s keep-alive timer, not a setting) are
still open at its end.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from bench.soak import PROFILE, emulator_args, free_port, gateway_args, process, wait_http

HEADERS = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nContent-Type: application/json\r\n"
    + b"X-Pad: "
    + b"a" * 4000
    + b"\r\n"
)
#: ``--quick``: the gateway's ``server.client_read_timeout_s`` and the seconds watched.
QUICK_READ_TIMEOUT_S = 2.0
QUICK_WATCH_S = 6.0
BODY_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n"
)


def watch(port: int, first: bytes, trickle: bytes, watch_s: float) -> str:
    """Send ``first`` at once, then ``trickle`` one byte per second (nothing when empty), reading
    what comes back, until the gateway closes the connection or ``watch_s`` seconds pass; says
    what it answered (status line, seconds after connecting) and when it closed."""
    sock = socket.create_connection(("127.0.0.1", port))
    start = time.monotonic()
    sent = 0
    answered = ""
    try:
        sock.sendall(first)
        sock.settimeout(1.0)
        while time.monotonic() - start < watch_s:
            if trickle:
                sock.send(trickle[sent % len(trickle) : sent % len(trickle) + 1])
                sent += 1
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            elapsed = time.monotonic() - start
            if not data:
                return f"{answered}closed by the gateway after {elapsed:.0f} s ({sent} bytes trickled)"
            if not answered:
                status = data.split(b"\r\n", 1)[0].decode(errors="replace")
                answered = f"answered {status!r} after {elapsed:.0f} s, "
    except OSError as exc:
        elapsed = time.monotonic() - start
        how = f"closed by the gateway ({exc.__class__.__name__})"
        return f"{answered}{how} after {elapsed:.0f} s ({sent} bytes trickled)"
    finally:
        sock.close()
    return f"{answered}still open after {watch_s:.0f} s ({sent} bytes trickled)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Slowloris connections against sluice serve.")
    parser.add_argument(
        "--watch-s",
        type=float,
        default=None,
        help=f"seconds to watch (default 110; {QUICK_WATCH_S:g} with --quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny configuration for CI: server.client_read_timeout_s {QUICK_READ_TIMEOUT_S:g} s, "
        f"{QUICK_WATCH_S:g} s watched",
    )
    args = parser.parse_args(argv)
    watch_s = args.watch_s if args.watch_s is not None else QUICK_WATCH_S if args.quick else 110.0
    with tempfile.TemporaryDirectory(prefix="sluice-slowloris-") as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        emu_port, gw_port = free_port(), free_port()
        emu_url = f"http://127.0.0.1:{emu_port}"
        emu = stack.enter_context(process(emulator_args(emu_port, 1, PROFILE), tmp / "emu.log"))
        wait_http(emu_url + "/health", emu)
        server: dict[str, float] = {"port": gw_port}
        if args.quick:
            server["client_read_timeout_s"] = QUICK_READ_TIMEOUT_S
        config = {"server": server, "replicas": [{"name": "emu", "url": emu_url}]}
        (tmp / "sluice.yaml").write_text(yaml.safe_dump(config))
        gw = stack.enter_context(process(gateway_args(tmp / "sluice.yaml"), tmp / "gateway.log"))
        wait_http(f"http://127.0.0.1:{gw_port}/readyz", gw)
        cases = {
            "idle": (b"", b""),
            "header dribbler": (b"", HEADERS),
            "body dribbler": (BODY_HEAD, b" "),
        }
        results: dict[str, str] = {}

        def run(name: str, first: bytes, trickle: bytes) -> None:
            results[name] = watch(gw_port, first, trickle, watch_s)

        threads = [threading.Thread(target=run, args=(n, *c)) for n, c in cases.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for name in cases:
        print(f"{name:>16}: {results[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
