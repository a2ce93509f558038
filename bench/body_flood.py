"""Maximum-size bodies of the worst shapes against ``sluice serve``: memory and ``/healthz``.

Starts one emulated replica and ``sluice serve`` (``server.max_body_bytes`` set to ``--body-mib``,
the JSON limits at their defaults), then, shape by shape, sends ``--concurrency`` bodies of
exactly ``server.max_body_bytes`` bytes at once while a probe asks ``/healthz`` every 10 ms on a
keep-alive connection. The shapes:

* ``nested``: chat ``messages`` nested ``[[[...]]]`` as deep as the body allows;
* ``empty-objects``: chat ``messages`` of ``{}`` items;
* ``token-ids``: a completions ``prompt`` of 5-digit token ids;
* ``accepted``: the largest chat body the limits accept: ``server.max_json_items`` values as
  ``{"role": "user", "content": "hi"}`` messages, the rest a string (``user``), ``max_tokens`` 1;
* ``accepted-stream``: the same asking for a stream, so that Sluice writes ``stream_options``
  into the body it forwards.

Prints, per shape, the statuses answered, the gateway's peak RSS during the round (``VmHWM``,
reset before each round through ``/proc/<pid>/clear_refs``) and ``/healthz``'s latency p50 and
max during the round; then the whole run's peak. Asserts nothing (``tests/integration/faults/
test_body_flood.py`` runs it small with bounds; results in docs/benchmarks.md).

Run: ``.venv/bin/python -m bench.body_flood`` (about 10 s; ``--body-mib 8 --concurrency 8`` by
default). ``--steps`` starts no server: it times, in this process, what one ``accepted-stream``
body costs at each step and says where the gateway runs it (the event loop or the body-parsing
thread), in CPU milliseconds (``time.thread_time``, best of 3).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench.soak import MODEL, PROFILE, emulator_args, free_port, gateway_args, process, wait_http
from gateway.api.json_body import DEFAULT_LIMITS, check_shape
from gateway.api.openai import parse_request, upstream_body
from gateway.api.prefix_text import prefix_text
from gateway.api.sliced_json import decode_in_slices
from gateway.api.tgi import json_bytes, json_bytes_in_pieces
from gateway.config.settings import ServerSettings
from gateway.tokens.counter import prompt_texts

#: Seconds between two ``/healthz`` probes.
PROBE_EVERY_S = 0.01


def _sized(head: bytes, item: bytes, tail: bytes, size: int) -> bytes:
    """``head`` + ``item`` repeated + ``tail``, padded with spaces before ``tail`` to ``size``."""
    count = (size - len(head) - len(tail)) // len(item)
    body = head + item * count + tail
    return body[: len(head) + len(item) * count] + b" " * (size - len(body)) + tail


def shapes(size: int, max_items: int) -> dict[str, tuple[str, bytes]]:
    """The bodies, each exactly ``size`` bytes, by name: (path, body)."""
    model = json.dumps(MODEL).encode()
    chat = b'{"model": ' + model + b', "max_tokens": 1, "messages": ['
    half = (size - len(chat) - 2) // 2
    nested = chat + b"[" * half + b"]" * half
    nested += b" " * (size - len(nested) - 2) + b"]}"
    empty = _sized(chat + b"{}", b",{}", b"]}", size)
    tokens = _sized(b'{"model": ' + model + b', "max_tokens": 1, "prompt": [12345', b",12345", b"]}", size)
    message = b'{"role": "user", "content": "hi"}'
    count = max_items // 3 - 16  # three values each: the message, its second member, the comma
    head = chat + b",".join([message] * count) + b'], "user": "'
    accepted = head + b"x" * (size - len(head) - 2) + b'"}'
    streamed = chat.replace(b'"max_tokens": 1,', b'"max_tokens": 1, "stream": true,')
    head = streamed + b",".join([message] * count) + b'], "user": "'
    accepted_stream = head + b"x" * (size - len(head) - 2) + b'"}'
    return {
        "nested": ("/v1/chat/completions", nested),
        "empty-objects": ("/v1/chat/completions", empty),
        "token-ids": ("/v1/completions", tokens),
        "accepted": ("/v1/chat/completions", accepted),
        "accepted-stream": ("/v1/chat/completions", accepted_stream),
    }


def status_kib(pid: int, key: str) -> int:
    """``key`` (``VmRSS``, ``VmHWM``) from ``/proc/<pid>/status``, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> None:
    """Reset ``VmHWM`` to the current RSS (Linux 4.0+; a no-op where it is refused)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


@dataclass
class Round:
    """One shape's round: statuses answered, peak RSS (MiB), ``/healthz`` latencies (s)."""

    shape: str
    statuses: list[int] = field(default_factory=list)
    peak_mib: float = 0.0
    healthz_s: list[float] = field(default_factory=list)

    @property
    def healthz_max_s(self) -> float:
        return max(self.healthz_s, default=0.0)

    def line(self) -> str:
        p50 = statistics.median(self.healthz_s) * 1e3 if self.healthz_s else 0.0
        counts = {s: self.statuses.count(s) for s in sorted(set(self.statuses))}
        return (
            f"{self.shape:>14}: statuses {counts}, peak RSS {self.peak_mib:.1f} MiB, "
            f"/healthz p50 {p50:.1f} ms max {self.healthz_max_s * 1e3:.1f} ms ({len(self.healthz_s)} probes)"
        )


def _post(port: int, path: str, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0  # the connection failed: reported as status 0
    finally:
        conn.close()


@contextlib.contextmanager
def probing(port: int, into: list[float]) -> Iterator[None]:
    """While the block runs, ``/healthz`` every ``PROBE_EVERY_S`` on one keep-alive connection,
    each answer's latency (s) appended to ``into``."""
    stop = threading.Event()

    def probe() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while not stop.is_set():
            start = time.perf_counter()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            into.append(time.perf_counter() - start)
            stop.wait(PROBE_EVERY_S)
        conn.close()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def flood_round(port: int, pid: int, name: str, path: str, body: bytes, concurrency: int) -> Round:
    """``concurrency`` copies of ``body`` sent at once to ``path``, probed and measured."""
    result = Round(name)
    reset_peak(pid)
    with probing(port, result.healthz_s):
        time.sleep(0.1)  # a few probes before the flood
        threads = [
            threading.Thread(target=lambda: result.statuses.append(_post(port, path, body)))
            for _ in range(concurrency)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    result.peak_mib = status_kib(pid, "VmHWM") / 1024
    return result


def flood(
    body_mib: float, concurrency: int, report: Callable[[str], None] = print
) -> tuple[float, list[Round]]:
    """The whole run: (gateway RSS before the first round in MiB, the rounds)."""
    size = int(body_mib * 1024 * 1024)
    max_items = ServerSettings().max_json_items
    with tempfile.TemporaryDirectory(prefix="sluice-body-flood-") as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        emu_port, gw_port = free_port(), free_port()
        emu_url = f"http://127.0.0.1:{emu_port}"
        emu = stack.enter_context(process(emulator_args(emu_port, 1, PROFILE), tmp / "emu.log"))
        wait_http(emu_url + "/health", emu)
        config = {
            "server": {"port": gw_port, "max_body_bytes": size},
            "replicas": [{"name": "emu", "url": emu_url}],
        }
        (tmp / "sluice.yaml").write_text(yaml.safe_dump(config))
        gw = stack.enter_context(process(gateway_args(tmp / "sluice.yaml"), tmp / "gateway.log"))
        wait_http(f"http://127.0.0.1:{gw_port}/readyz", gw)
        before = status_kib(gw.pid, "VmRSS") / 1024
        report(f"gateway RSS before: {before:.1f} MiB; bodies of {size} bytes, {concurrency} at once")
        rounds = []
        for name, (path, body) in shapes(size, max_items).items():
            rounds.append(flood_round(gw_port, gw.pid, name, path, body, concurrency))
            report(rounds[-1].line())
    return before, rounds


def _cpu_ms(call: Callable[[], object]) -> float:
    """``call``'s CPU time in this thread, best of 3, in milliseconds."""
    best = math.inf
    for _ in range(3):
        start = time.thread_time()
        call()
        best = min(best, time.thread_time() - start)
    return best * 1e3


def steps(body_mib: float, report: Callable[[str], None] = print) -> dict[str, float]:
    """One ``accepted-stream`` body of ``body_mib`` MiB, step by step: CPU ms by step name."""
    size = int(body_mib * 1024 * 1024)
    raw = shapes(size, ServerSettings().max_json_items)["accepted-stream"][1]
    parsed = parse_request("chat", raw)
    body, text = parsed.body, raw.decode()
    decoder = json.JSONDecoder()
    timed = {
        "check_shape": ("body thread", lambda: check_shape(raw, DEFAULT_LIMITS)),
        "json.loads (one C call)": ("not used", lambda: json.loads(text)),
        "decode_in_slices (a C call per message)": ("body thread", lambda: decode_in_slices(decoder, text)),
        "parse_request (check, decode, validate)": ("body thread", lambda: parse_request("chat", raw)),
        "upstream_body (stream_options written in)": ("event loop", lambda: upstream_body(parsed)),
        "json_bytes_in_pieces (a member replaced)": ("body thread", lambda: json_bytes_in_pieces(body)),
        "json_bytes (the whole body, one C call)": ("not used", lambda: json_bytes(body)),
        "prefix_text (the prefix cache's text)": ("body thread", lambda: prefix_text(parsed)),
        "PromptTexts of its messages": ("counting thread", lambda: prompt_texts(parsed)),
    }
    report(f"one accepted-stream body of {size} bytes ({len(parsed.body['messages'])} messages), CPU ms:")
    result = {}
    for name, (where, call) in timed.items():
        result[name] = _cpu_ms(call)
        report(f"  {name:44s} {result[name]:7.2f}  ({where})")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Maximum-size JSON bodies against sluice serve.")
    parser.add_argument(
        "--body-mib", type=float, default=8.0, help="server.max_body_bytes in MiB (default 8)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="bodies sent at once (default 8)")
    parser.add_argument(
        "--steps", action="store_true", help="no servers: time each step of one body in this process"
    )
    args = parser.parse_args(argv)
    if args.steps:
        steps(args.body_mib)
        return 0
    _, rounds = flood(args.body_mib, args.concurrency)
    peak = max(r.peak_mib for r in rounds)
    worst = max(r.healthz_max_s for r in rounds)
    print(f"peak RSS {peak:.1f} MiB; /healthz max {worst * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
