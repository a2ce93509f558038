"""Slow clients: a stream consumer that never reads cannot pin the gateway's memory or a replica.

The client is a raw socket with a small receive buffer (``SO_RCVBUF`` 4 KiB) that sends a streamed
chat completion and never calls ``recv``. The kernel first absorbs what the gateway writes (its
send buffer autotunes up to ``net.ipv4.tcp_wmem``'s maximum, 4 MiB by default: a real 8,000-token
stream of the emulator, about 1.6 MB, fits whole, see docs/operations.md), then aiohttp's
``StreamResponse.write`` waits in ``drain()``: backpressure, the gateway stops reading the
replica's stream instead of buffering it. After ``server.client_write_timeout_s`` (2 s here)
without progress the gateway ends the exchange as a client disconnect: it aborts the client's
connection and closes the upstream request, freeing the replica.

The replica is a FAKE, deliberately: ``FirehoseFront`` (the rig's ``FaultyFront`` in front of a
real emulator, which answers health, models and metrics) streams endless 64 KiB chat chunks, so
the kernel's buffers fill in seconds; no real replica emits megabytes that fast.

Asserted: the fake replica sees its request closed within the write timeout plus generous margins
while the client still has not read a byte; the gateway's RSS stays within 64 MiB of its size
before the stream (it does not buffer what the client will not take); the client then finds its
connection closed without ``[DONE]``; the access line says ``client_disconnected``.

Body dribblers (``test_body_dribblers_get_408_and_touch_no_budget_nor_replica``): raw sockets send
complete headers, then the body one byte every 0.2 s, never finishing it, and keep sending
whatever they are told. With ``server.client_read_timeout_s`` at 2 s each gets a 408 JSON error
(``request_timeout``, ``Connection: close``) and then finds its connection closed (after
aiohttp's lingering close, at most 10 s): the gateway neither waits for ever nor pins the
connection. Meanwhile the gateway serves others, a body sent in two halves within the timeout
still goes through whole, the replica receives only those legitimate requests, and the
dribblers' tenant, whose budget is one request a minute, still has its request afterwards:
nothing was reserved for them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.soak import MODEL, free_port, rss_mib
from gateway.tenants import hash_api_key
from tests.integration.faults.rig import Emulator, FaultyFront, gateway
from tests.support import speed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HARDWARE = {"gpu": "H100-SXM", "model": "Llama-3-8B"}
WRITE_TIMEOUT_S = 2.0
MAX_TOKENS = 8000
#: Content of one fake chunk, in bytes.
CHUNK_BYTES = 64 * 1024
#: The stalled stream's upstream request is closed within this (seconds; the buffers fill and the
#: write timeout runs out in a few): a sanity bound, scaled by the host-speed factor.
CLOSED_WITHIN_S = speed.scaled(30.0)


class FirehoseFront(FaultyFront):
    """``FaultyFront`` whose completions are an endless stream of big chat chunks (a fake: see
    the module). Records the bytes sent and when the gateway closed the request."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.sent_bytes = 0
        self.closed_at: float | None = None

    async def _relay(self, request: web.Request, mode: str) -> web.StreamResponse:
        if not (request.path.startswith("/v1/") and request.method == "POST"):
            return await super()._relay(request, mode)
        await request.read()
        response = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {
            "id": "chatcmpl-firehose",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": "x" * CHUNK_BYTES}, "finish_reason": None}],
        }
        event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        try:
            while True:
                await response.write(event)
                self.sent_bytes += len(event)
        except ConnectionError:  # the gateway closed the request
            self.closed_at = time.monotonic()
            return response


def _stalled_stream(port: int) -> socket.socket:
    """A connection that asked for a long stream and will never read it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "write a long story"}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _drain_socket(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything left to read and whether the connection was closed (EOF or reset) in time."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return data, True
    except TimeoutError:
        return data, False
    return data, True


async def test_a_client_that_never_reads_is_cut_and_frees_the_replica(tmp_path: Path) -> None:
    emulator = Emulator("emu")
    emulator.start()
    front = FirehoseFront(emulator.url)
    await front.start()
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port, "client_write_timeout_s": WRITE_TIMEOUT_S},
        "replicas": [{"name": "emu", "url": front.url, "hardware": HARDWARE}],
        "logging": {"level": "INFO", "access_log": True},
    }
    try:
        async with gateway(tmp_path, config) as gw:
            pid = gw.proc.popen.pid
            await asyncio.sleep(1.0)
            before = rss_mib(pid)
            sock = await asyncio.to_thread(_stalled_stream, port)
            try:
                start = time.monotonic()
                peak = before
                while front.closed_at is None and time.monotonic() - start < CLOSED_WITHIN_S + 10.0:
                    peak = max(peak, rss_mib(pid))
                    await asyncio.sleep(0.25)
                assert front.closed_at is not None, f"the stalled stream is still running\n{gw.log()}"
                closed_after = front.closed_at - start
                data, closed = await asyncio.to_thread(_drain_socket, sock, 10.0)
            finally:
                sock.close()
            await asyncio.sleep(0.5)
            log = gw.log()
    finally:
        await front.close()
        emulator.stop()
    print(
        f"upstream closed {closed_after:.1f} s after the request, {front.sent_bytes / 2**20:.1f} MiB sent; "
        f"gateway RSS {before:.1f} -> peak {peak:.1f} MiB"
    )
    assert closed_after < CLOSED_WITHIN_S
    assert peak < before + 64.0, (before, peak)
    assert closed, "the gateway kept the stalled connection open"
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert b"[DONE]" not in data
    assert "error=client_disconnected" in log, log[-3000:]


READ_TIMEOUT_S = 2.0
#: A dribbler's 408 comes before this (seconds): a sanity bound, scaled by the host-speed factor.
ANSWERED_WITHIN_S = READ_TIMEOUT_S + speed.scaled(15.0)
#: The dribblers' tenant: one request a minute, so a reservation made for a dribbler would refuse
#: the request sent after them.
DRIBBLER_KEY = "sk-slow-dribbler-41c2"
#: Everyone else: no limits.
OTHER_KEY = "sk-slow-other-0b9e"
DRIBBLERS = 6


def _chat_body(content: str = "say something") -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    ).encode()


def _head(port: int, key: str, length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@dataclass
class Dribbled:
    """What one body dribbler saw: the bytes it received, and when (seconds after its headers)
    the first answer byte arrived and the connection was closed (``None``: not within the watch)."""

    data: bytes = b""
    answered_after_s: float | None = None
    closed_after_s: float | None = None


def _dribble(port: int, watch_s: float) -> Dribbled:
    """Complete headers, then the body one byte every 0.2 s, never all of it, reading whatever
    comes back, until the gateway closes the connection or ``watch_s`` seconds pass."""
    body = _chat_body("x" * 2000)
    seen = Dribbled()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_head(port, DRIBBLER_KEY, len(body)) + body[:10])
        start = time.monotonic()
        sock.settimeout(0.2)
        sent = 10
        while time.monotonic() - start < watch_s:
            try:
                if sent < len(body) - 1:  # never the last byte
                    sock.send(body[sent : sent + 1])
                    sent += 1
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset, broken pipe: the gateway closed the connection
                chunk = b""
            if not chunk:
                seen.closed_after_s = time.monotonic() - start
                return seen
            if seen.answered_after_s is None:
                seen.answered_after_s = time.monotonic() - start
            seen.data += chunk
    return seen


def _split_body(port: int, pause_s: float) -> bytes:
    """A chat request whose body arrives in two halves ``pause_s`` apart; the whole answer."""
    body = _chat_body()
    with socket.create_connection(("127.0.0.1", port), timeout=60.0) as sock:
        sock.sendall(_head(port, OTHER_KEY, len(body)) + body[: len(body) // 2])
        time.sleep(pause_s)
        sock.sendall(body[len(body) // 2 :])
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


async def _chat(session: aiohttp.ClientSession, url: str, key: str) -> int:
    async with session.post(
        f"{url}/v1/chat/completions",
        data=_chat_body(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    ) as resp:
        await resp.read()
        return resp.status


async def test_body_dribblers_get_408_and_touch_no_budget_nor_replica(tmp_path: Path) -> None:
    emulator = Emulator("emu")
    emulator.start()
    front = FaultyFront(emulator.url)
    await front.start()
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port, "client_read_timeout_s": READ_TIMEOUT_S},
        "replicas": [{"name": "emu", "url": front.url, "hardware": HARDWARE}],
        "logging": {"level": "INFO", "access_log": True},
        "tenants": {
            "tenants": {
                "dribblers": {
                    "api_keys": [hash_api_key(DRIBBLER_KEY)],
                    "limits": {"requests_per_minute": 1},
                },
                "others": {"api_keys": [hash_api_key(OTHER_KEY)]},
            }
        },
    }
    try:
        async with gateway(tmp_path, config) as gw, aiohttp.ClientSession() as session:
            watch_s = READ_TIMEOUT_S + speed.scaled(30.0)  # the timeout, aiohttp's lingering, margins
            dribblers = [asyncio.to_thread(_dribble, port, watch_s) for _ in range(DRIBBLERS)]
            running = asyncio.gather(*dribblers)
            await asyncio.sleep(0.3)
            # While they dribble: others are served, a body in two halves within the timeout too.
            during = [await _chat(session, gw.url, OTHER_KEY) for _ in range(3)]
            split = await asyncio.to_thread(_split_body, port, 0.3)
            seen = await running
            # Their tenant's one request a minute is intact: nothing was reserved for them.
            after = await _chat(session, gw.url, DRIBBLER_KEY)
            await asyncio.sleep(0.5)
            log = gw.log()
    finally:
        await front.close()
        emulator.stop()
    print(
        "dribblers answered after "
        + ", ".join(f"{d.answered_after_s:.1f}" if d.answered_after_s else "-" for d in seen)
        + " s, closed after "
        + ", ".join(f"{d.closed_after_s:.1f}" if d.closed_after_s else "-" for d in seen)
        + " s"
    )
    assert during == [200, 200, 200]
    assert split.startswith(b"HTTP/1.1 200"), split[:300]
    assert after == 200, log[-3000:]
    for dribbled in seen:
        head, _, body = dribbled.data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), dribbled.data[:300]
        assert b"connection: close" in head.lower(), head
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout", error
        assert error["type"] == "invalid_request_error", error
        # Not before the timeout; within generous margins after it (a loaded 2-core machine).
        assert dribbled.answered_after_s is not None
        assert READ_TIMEOUT_S - 0.5 <= dribbled.answered_after_s < READ_TIMEOUT_S + speed.scaled(15.0), (
            dribbled
        )
        assert dribbled.closed_after_s is not None, "the gateway kept a dribbler's connection open"
    # The replica got the legitimate requests only: 3 during, the split one, the one after.
    assert front.completion_requests == 5, front.completion_requests
    assert log.count("error=request_timeout") == DRIBBLERS, log[-3000:]
