"""The fault tests' rig: real emulators, a real ``redis-server``, ``sluice serve``, a load, a ledger.

Every test starts its own processes on free ports:

* ``Emulator``: ``python -m simulator`` (a vLLM look-alike); ``kill()`` is SIGKILL, ``start()``
  again reuses the same port (a replica restarted in place);
* ``Gateway``: ``sluice serve --config FILE`` with ``gateway_config``'s file: admission admits
  everything (``admit_all``, so no request is refused for load: every failure is the fault's),
  one tenant ``team-a`` whose budget lives in the test's Redis, token weights pinned (prompt 1,
  output 2), ``fail_closed`` (a Redis hiccup would show as a 503, never as silently local
  accounting);
* ``FaultyFront``: the one deliberate fake, for faults a real emulator cannot produce on demand.
  It is a reverse proxy in the test process in front of a real emulator: it passes every request
  through unchanged until a test switches one path to a fault (hang without answering, stall a
  stream, cut a stream short, drop the connection, answer garbage).

The ledger
    The tenant's token budget is ``LEDGER_LIMITS``: a bucket of 1e9 weighted tokens refilling at
    0.001 tokens per second, so the bucket's deficit in Redis is, to within a few thousandths of
    a token per test, the sum of what the tenant was charged: ``Ledger.read`` computes it from the
    bucket's ``full_at`` key on Redis's own clock, with the number of unsettled leases.

    ``expected_charge`` is what ``gateway/tenants/live.py`` documents a request costs, from what the
    client saw: usage when the answer carried it, else the prompt plus the content events it
    streamed (a cut stream), else the prompt alone (a 502: the replica got the request), else
    nothing (refused before any replica got it). Every request's prompt is ``PROMPT_TOKENS``
    token ids, so the gateway's prompt estimate is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.tenants import hash_api_key
from tests.support import speed
from tests.support.procs import ROOT, Proc, free_port, python_module
from tests.support.redis import RedisServer

KEY: Final = "sk-faults-team-a-93f1"
TENANT: Final = "team-a"
MODEL: Final = "meta-llama/Meta-Llama-3-8B-Instruct"
PROFILE: Final = "llama3-8b-h100"
HARDWARE: Final = {"gpu": "H100-SXM", "model": "Llama-3-8B"}
PROMPT_TOKENS: Final = 16
#: Weighted tokens per output token (``limits.token_weights.output``); a prompt token weighs 1.
OUTPUT_WEIGHT: Final = 2.0
#: Refill rate of the ledger bucket, tokens per minute: 0.001 tokens per second.
LEDGER_TPM: Final = 0.06
LEDGER_CAPACITY: Final = 1.0e9
LEDGER_LIMITS: Final = {
    "tokens_per_minute": LEDGER_TPM,
    "token_burst": LEDGER_CAPACITY,
    "max_concurrent": 10_000,
}
#: Charges are compared within this many weighted tokens (refill drift over a test: < 0.1).
LEDGER_TOLERANCE: Final = 0.5
AUTH: Final = {"Authorization": f"Bearer {KEY}"}


# -- processes ---------------------------------------------------------------------------------------


class Emulator:
    """One emulated vLLM replica on a fixed port; ``kill`` then ``start`` restarts it in place."""

    def __init__(self, name: str, *, seed: int = 1, port: int | None = None) -> None:
        self.name = name
        self.seed = seed
        self.port = port if port is not None else free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Emulator:
        args = python_module(
            "simulator",
            "--profile",
            PROFILE,
            "--port",
            str(self.port),
            "--seed",
            str(self.seed),
            "--log-level",
            "WARNING",
        )
        self.proc = Proc(args, name=f"emulator-{self.name}")
        self.proc.wait_http(self.url + "/health", timeout_s)
        return self

    def kill(self) -> None:
        """SIGKILL: the replica dies with its connections open, as a crashed vLLM does."""
        if self.proc is not None:
            self.proc.stop(signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@contextlib.contextmanager
def emulators(*names: str) -> Iterator[list[Emulator]]:
    """Started emulators, one per name (seeds 1, 2, ...), stopped on exit."""
    started = [Emulator(name, seed=i) for i, name in enumerate(names, start=1)]
    try:
        for emulator in started:
            emulator.start()
        yield started
    finally:
        for emulator in started:
            emulator.stop()


def sluice() -> list[str]:
    exe = shutil.which("sluice") or str(ROOT / ".venv" / "bin" / "sluice")
    return [exe]


def gateway_config(
    port: int,
    replicas: dict[str, str],
    redis_url: str,
    *,
    server: dict[str, Any] | None = None,
    health: dict[str, Any] | None = None,
    reload: dict[str, Any] | None = None,
    limits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A gateway in front of ``replicas`` (name -> URL) with the ledger tenant (see the module);
    ``server``, ``health``, ``reload`` and ``limits`` update those sections.

    Health checks and scrapes time out after half a second scaled by the host-speed factor
    (measured now): on a busy host an emulator that answers in 0.6 s is slow, not down, and a
    replica marked unhealthy for it would turn a test of something else into 503s."""
    beat = round(0.5 * speed.factor(fresh=True), 3)
    return {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 5.0, **(server or {})},
        "replicas": [{"name": name, "url": url, "hardware": HARDWARE} for name, url in replicas.items()],
        "health": {"interval_s": beat, "timeout_s": beat, "unhealthy_after": 2, **(health or {})},
        "scrape": {"interval_s": beat, "timeout_s": beat, "window_s": max(5.0, 4 * beat)},
        "reload": {"watch": False, **(reload or {})},
        "logging": {"level": "INFO", "access_log": True},
        "admission": {"policy": "admit_all"},
        "tenants": {"tenants": {TENANT: {"api_keys": [hash_api_key(KEY)], "limits": LEDGER_LIMITS}}},
        "limits": {
            "backend": "redis",
            "redis": {"url": redis_url, "timeout_s": 1.0},
            "on_storage_error": "fail_closed",
            "token_weights": {"prompt": 1.0, "output": OUTPUT_WEIGHT},
            **(limits or {}),
        },
    }


@dataclass
class Gateway:
    """A ``sluice serve --config`` process."""

    url: str
    proc: Proc
    config_path: Path

    def log(self) -> str:
        return self.proc.output()

    def alive(self) -> bool:
        return self.proc.popen.poll() is None

    def signal(self, sig: int) -> None:
        self.proc.popen.send_signal(sig)

    def write_config(self, text: str) -> None:
        """Replace the configuration file atomically (as an editor or a ConfigMap update does)."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config_path)

    async def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics`` by ``name{label="value",...}`` (labels sorted)."""
        async with aiohttp.ClientSession() as session, session.get(self.url + "/metrics") as resp:
            text = await resp.text()
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
        return samples

    async def replica_states(self) -> dict[str, str]:
        """Each replica's state as ``/readyz`` lists it."""
        async with aiohttp.ClientSession() as session, session.get(self.url + "/readyz") as resp:
            body = await resp.json()
        return {str(r["name"]): str(r["state"]) for r in body["replicas"]}

    async def wait_state(self, replica: str, state: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self.replica_states()).get(replica) == state:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"replica {replica} not {state} after {timeout_s}s: {await self.replica_states()}")


@contextlib.asynccontextmanager
async def gateway(directory: Path, config: dict[str, Any]) -> AsyncIterator[Gateway]:
    """``sluice serve --config`` ready on ``/readyz`` and listing the model; stopped on exit.

    Waiting runs in a thread: a ``FaultyFront`` in this event loop must keep answering meanwhile.
    """
    path = directory / "sluice.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc([*sluice(), "serve", "--config", str(path)], name="gateway")
    url = f"http://127.0.0.1:{config['server']['port']}"
    try:
        await asyncio.to_thread(proc.wait_http, url + "/readyz", 60.0)
        await asyncio.to_thread(_wait_for_model, proc, url)
        yield Gateway(url, proc, path)
    finally:
        await asyncio.to_thread(proc.stop)


def _wait_for_model(proc: Proc, url: str, timeout_s: float = 30.0) -> None:
    """Until a healthy replica serves a model, as ``/readyz`` lists them (no admin token is set
    here, so it lists the replicas; ``/v1/models`` would need the key of whichever tenant the
    configuration holds)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(urllib.error.HTTPError),
            urllib.request.urlopen(url + "/readyz", timeout=5) as resp,
        ):
            replicas = json.loads(resp.read()).get("replicas", [])
            if any(r["state"] == "healthy" and r["models"] for r in replicas):
                return
        time.sleep(0.1)
    raise TimeoutError(f"the gateway listed no model:\n{proc.output()}")


# -- the ledger --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LedgerState:
    """The tenant's budget in Redis: weighted tokens charged so far, and unsettled leases."""

    charged: float
    unsettled: int


class Ledger:
    """Reads ``team-a``'s bucket and leases from Redis (``gateway/limits/*.lua``'s keys)."""

    def __init__(self, redis: RedisServer) -> None:
        self.redis = redis
        base = "sluice:{" + TENANT + "}"
        self.tokens_key = f"{base}:tokens"
        self.leases_key = f"{base}:leases"

    def read(self) -> LedgerState:
        """The bucket's deficit (capacity - level, on Redis's clock) and the lease count.

        One snapshot: the three reads run in one MULTI/EXEC, so no settle lands between them.
        (Read one by one, a settle landing between the bucket and the leases made a reservation
        look settled without its refund: charged at its full reservation.)
        """
        with self.redis.client() as client:
            pipe = client.pipeline(transaction=True)
            pipe.time()
            pipe.get(self.tokens_key)
            pipe.zcard(self.leases_key)
            (seconds, micros), full_at, leases = pipe.execute()
        now = seconds + micros / 1e6
        deficit = 0.0 if full_at is None else max(0.0, (float(full_at) - now) * LEDGER_TPM / 60.0)
        return LedgerState(deficit, leases)

    async def settled(self, timeout_s: float = 20.0) -> LedgerState:
        """The state once no lease is left (settles run after the response); raises if one stays."""
        deadline = time.monotonic() + timeout_s
        state = self.read()
        while state.unsettled and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            state = self.read()
        assert state.unsettled == 0, f"{state.unsettled} reservation(s) never settled"
        return state


# -- clients -----------------------------------------------------------------------------------------


@dataclass
class Call:
    """What one client saw of one request.

    ``status``: the HTTP status (``None``: no response at all, e.g. the connection was refused).
    ``error``: the JSON error body's or the SSE error event's ``error`` object. ``tokens``: content
    events received (what the gateway counts as streamed). ``done``: ``data: [DONE]`` arrived.
    ``usage``: (prompt, completion) when the answer carried it. ``exception``: the client-side
    exception's class name when the response broke off without a clean end.
    """

    stream: bool
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    tokens: int = 0
    done: bool = False
    usage: tuple[int, int] | None = None
    exception: str | None = None
    raw_body: bytes = b""
    events_after_error: int = 0

    @property
    def replica(self) -> str | None:
        return self.headers.get("x-sluice-replica")

    @property
    def cut(self) -> bool:
        """A stream that started (200) and ended with an error event instead of ``[DONE]``."""
        return self.stream and self.status == 200 and self.error is not None and not self.done


def expected_charge(call: Call) -> float:
    """Weighted tokens the engine's settle charges for ``call`` (``AdmissionEngine.finish``)."""
    if call.status is None or (call.status != 200 and call.status != 502):
        return 0.0
    if call.usage is not None:
        prompt, completion = call.usage
        return prompt + OUTPUT_WEIGHT * completion
    return PROMPT_TOKENS + OUTPUT_WEIGHT * call.tokens


def body(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """A ``/v1/completions`` body: ``PROMPT_TOKENS`` token ids, exactly ``max_tokens`` out."""
    payload: dict[str, Any] = {
        "model": MODEL,
        "prompt": [11] * PROMPT_TOKENS,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    return payload


def _carries_tokens(payload: Any) -> bool:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    return isinstance(choices, list) and any(
        isinstance(c, dict) and (c.get("text") or c.get("finish_reason")) for c in choices
    )


async def call(
    session: aiohttp.ClientSession,
    base: str,
    *,
    max_tokens: int,
    stream: bool,
    started: asyncio.Event | None = None,
    started_after: int = 3,
    calls: list[Call] | None = None,
) -> Call:
    """One ``/v1/completions`` request; never raises for what the gateway or network does.

    ``started`` is set once a stream has delivered ``started_after`` content events (or ended).
    ``calls``: the result is appended there at once (so an outer cancellation keeps the record).
    """
    result = Call(stream=stream)
    if calls is not None:
        calls.append(result)
    try:
        async with session.post(
            base + "/v1/completions", json=body(max_tokens, stream=stream), headers=AUTH
        ) as resp:
            result.status = resp.status
            result.headers = {k.lower(): v for k, v in resp.headers.items()}
            if not stream or resp.status != 200:
                result.raw_body = await resp.read()
                _read_json_answer(result)
            else:
                await _read_events(resp, result, started, started_after)
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        result.exception = exc.__class__.__name__
    finally:
        if started is not None:
            started.set()
    return result


def _read_json_answer(result: Call) -> None:
    try:
        payload = json.loads(result.raw_body)
    except ValueError:
        return
    if not isinstance(payload, dict):
        return
    if isinstance(payload.get("error"), dict):
        result.error = payload["error"]
    usage = payload.get("usage")
    if isinstance(usage, dict):
        result.usage = (int(usage["prompt_tokens"]), int(usage["completion_tokens"]))


async def _read_events(
    resp: aiohttp.ClientResponse, result: Call, started: asyncio.Event | None, started_after: int
) -> None:
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            data = b"\n".join(line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:"))
            if not data:  # a comment or keep-alive line: no data field
                continue
            if result.error is not None:
                result.events_after_error += 1
                continue
            if data == b"[DONE]":
                result.done = True
                continue
            payload = json.loads(data)
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                result.error = payload["error"]
                continue
            if _carries_tokens(payload):
                result.tokens += 1
                if started is not None and result.tokens >= started_after:
                    started.set()
            usage = payload.get("usage") if isinstance(payload, dict) else None
            if isinstance(usage, dict):
                result.usage = (int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
    result.raw_body = buffer


def assert_openai_error(error: dict[str, Any] | None, code: str) -> dict[str, Any]:
    """``error`` is OpenAI's error object with ``code`` and a message free of tracebacks; returns it."""
    assert error is not None, "no error object"
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    assert "Traceback" not in str(error["message"]), error
    return error


def total_charge(calls: list[Call]) -> float:
    return sum(expected_charge(c) for c in calls)


async def settled_metric(gateway: Gateway, expect: float | None = None, timeout_s: float = 5.0) -> float:
    """``sluice_tenant_tokens_settled_total`` of the tenant (0 before its first settle).

    With ``expect``, waits up to ``timeout_s`` for it to come within ``LEDGER_TOLERANCE`` of that
    (the counter moves just after the settle's Redis call returns) and returns the last value.
    """
    name = f'sluice_tenant_tokens_settled_total{{tenant="{TENANT}"}}'
    deadline = time.monotonic() + timeout_s
    while True:
        value = (await gateway.metrics()).get(name, 0.0)
        if expect is None or abs(value - expect) <= LEDGER_TOLERANCE or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


# -- the deliberate fake -----------------------------------------------------------------------------


class FaultyFront:
    """A reverse proxy in front of a real emulator that injects faults on demand.

    A FAKE, deliberately: a real replica cannot be made to hang with its sockets open, stall a
    stream halfway, or answer garbage on cue. Until a test sets a mode everything passes through
    unchanged, so the gateway first sees a healthy replica.

    ``health``: ``pass`` | ``hang`` (``/health`` accepted and never answered).
    ``completions``: ``pass`` | ``hang`` (accepted, never answered) | ``hold`` (accepted and
    kept unanswered until ``release_held``, then passed through) | ``stall`` (relay
    ``after_events`` events, then silence with the connection open) | ``truncate`` (relay
    ``after_events`` events, then end the response cleanly without ``[DONE]``) | ``drop`` (relay
    ``after_events`` events, then close the TCP connection) | ``non_json`` (200 with an HTML body).
    ``metrics``: ``pass`` | ``garbage`` (200 with text no Prometheus parser accepts).
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.health = "pass"
        self.completions = "pass"
        self.metrics = "pass"
        self.after_events = 3
        #: Completion requests received (each one the gateway dispatched here).
        self.completion_requests = 0
        self._release = asyncio.Event()
        self._held = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultyFront:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession()
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    def release_held(self) -> None:
        """Let every request ``hold`` keeps (and any later one) through to the emulator."""
        self._held.set()

    async def close(self) -> None:
        self._release.set()  # hung handlers return, so the runner stops at once
        self._held.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _hang(self) -> web.Response:
        await self._release.wait()
        return web.Response(status=503, text="fake replica closing")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/health" and self.health == "hang":
            return await self._hang()
        if path == "/metrics" and self.metrics == "garbage":
            return web.Response(text="vllm:num_requests_running{{{ 12 garbage\n\x00\xff not prometheus {\n")
        if path.startswith("/v1/") and request.method == "POST":
            self.completion_requests += 1
            mode = self.completions
            if mode == "hang":
                return await self._hang()
            if mode == "hold":
                await self._held.wait()
                return await self._relay(request, "pass")
            if mode == "non_json":
                await request.read()
                return web.Response(
                    status=200, text="<html><body>upstream blew up</body></html>", content_type="text/html"
                )
            return await self._relay(request, mode)
        return await self._relay(request, "pass")

    async def _relay(self, request: web.Request, mode: str) -> web.StreamResponse:
        assert self._session is not None
        data = await request.read()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=data, headers=headers
        ) as upstream:
            if "text/event-stream" not in upstream.headers.get("content-type", ""):
                payload = await upstream.read()
                return web.Response(
                    status=upstream.status,
                    body=payload,
                    content_type=upstream.content_type,
                )
            response = web.StreamResponse(
                status=upstream.status, headers={"content-type": "text/event-stream"}
            )
            await response.prepare(request)
            relayed = 0
            buffer = b""
            async for chunk in upstream.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if mode != "pass" and relayed >= self.after_events:
                        return await self._fault_mid_stream(request, response, mode)
                    await response.write(event + b"\n\n")
                    relayed += 1
            await response.write_eof()
            return response

    async def _fault_mid_stream(
        self, request: web.Request, response: web.StreamResponse, mode: str
    ) -> web.StreamResponse:
        if mode == "stall":
            await self._release.wait()
        elif mode == "drop":
            if request.transport is not None:
                request.transport.abort()
            return response
        await response.write_eof()  # truncate: a clean end of the body, without [DONE]
        return response


@contextlib.asynccontextmanager
async def faulty_front(upstream: str) -> AsyncIterator[FaultyFront]:
    front = await FaultyFront(upstream).start()
    try:
        yield front
    finally:
        await front.close()
