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
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest
from aiohttp import web

from bench.soak import MODEL, free_port, rss_mib
from tests.integration.faults.rig import Emulator, FaultyFront, gateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HARDWARE = {"gpu": "H100-SXM", "model": "Llama-3-8B"}
WRITE_TIMEOUT_S = 2.0
MAX_TOKENS = 8000
#: Content of one fake chunk, in bytes.
CHUNK_BYTES = 64 * 1024


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
                while front.closed_at is None and time.monotonic() - start < 40.0:
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
    assert closed_after < 30.0
    assert peak < before + 64.0, (before, peak)
    assert closed, "the gateway kept the stalled connection open"
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert b"[DONE]" not in data
    assert "error=client_disconnected" in log, log[-3000:]
