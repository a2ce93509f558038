"""Real processes for the tenancy tests: an emulated replica, N ``sluice serve`` gateways, a load.

Every request is a ``/v1/completions`` call whose prompt is ``PROMPT_TOKENS`` token ids, so the
gateway's prompt estimate is exact, with ``max_tokens = MAX_TOKENS``, which caps the predicted
output; token weights are pinned (prompt 1, output 2). A request therefore reserves exactly
``RESERVED`` weighted tokens and is settled to ``usage.prompt + 2 x usage.completion`` <= that:
settles only ever refund, so the tokens a tenant is charged are what the clients saw in the
usage of their 200 answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.tenants import hash_api_key
from tests.support.procs import ROOT, Proc, free_port, python_module

KEY = "sk-integration-team-a-4c1e"
TENANT = "team-a"
PROMPT_TOKENS = 16
MAX_TOKENS = 8
RESERVED = PROMPT_TOKENS + 2 * MAX_TOKENS
BODY: dict[str, Any] = {"model": "", "prompt": [11] * PROMPT_TOKENS, "max_tokens": MAX_TOKENS}


def sluice() -> list[str]:
    exe = shutil.which("sluice") or str(ROOT / ".venv" / "bin" / "sluice")
    return [exe]


@contextlib.contextmanager
def emulator(seed: int = 1, profile: str = "llama3-8b-h100") -> Iterator[str]:
    """An emulated vLLM replica (``python -m simulator``, ``profile``: a name or a path) on a
    free port; yields its URL."""
    port = free_port()
    proc = Proc(
        python_module("simulator", "--profile", profile, "--port", str(port), "--seed", str(seed)),
        name="emulator",
    )
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def gateway_config(
    replica_url: str,
    port: int,
    *,
    limits: dict[str, Any],
    tenant_limits: dict[str, Any],
    level: str = "INFO",
) -> dict[str, Any]:
    """A gateway config: one replica, tenant ``team-a`` (key ``KEY``), ``limits:`` as given.

    Admission admits everything (``admit_all``): these tests are about tenant budgets only.
    """
    return {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 1.0},
        "replicas": [{"name": "emu", "url": replica_url}],
        "health": {"interval_s": 1.0, "timeout_s": 1.0},
        "reload": {"watch": False},
        "logging": {"level": level, "access_log": False},
        "admission": {"policy": "admit_all"},
        "tenants": {"tenants": {TENANT: {"api_keys": [hash_api_key(KEY)], "limits": tenant_limits}}},
        "limits": {**limits, "token_weights": {"prompt": 1.0, "output": 2.0}},
    }


@dataclass
class Gateway:
    url: str
    proc: Proc

    def log(self) -> str:
        return self.proc.output()

    def alive(self) -> bool:
        return self.proc.popen.poll() is None


@contextlib.contextmanager
def gateways(directory: Path, configs: list[dict[str, Any]]) -> Iterator[list[Gateway]]:
    """``sluice serve --config`` once per config (started together), each ready on /readyz."""
    started: list[Gateway] = []
    try:
        for index, config in enumerate(configs):
            path = directory / f"gateway-{index}.yaml"
            path.write_text(yaml.safe_dump(config))
            proc = Proc([*sluice(), "serve", "--config", str(path)], name=f"gateway-{index}")
            started.append(Gateway(f"http://127.0.0.1:{config['server']['port']}", proc))
        for gateway in started:
            gateway.proc.wait_http(gateway.url + "/readyz")
        yield started
    finally:
        for gateway in started:
            gateway.proc.stop()


async def model_of(url: str) -> str:
    """The model the gateway's replica serves (waits until it is listed)."""
    deadline = time.monotonic() + 30.0
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as resp:
                data = (await resp.json())["data"]
            if data:
                return str(data[0]["id"])
            await asyncio.sleep(0.1)
    raise TimeoutError("no model listed")


@dataclass
class Load:
    """What the clients saw. ``charged``: weighted tokens in the usage of 200 answers."""

    started_at: float = 0.0
    ended_at: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    charged: float = 0.0
    admitted: int = 0
    prompt_mismatches: int = 0
    #: (seconds since start, status) of every answer, in arrival order.
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at


async def drive(
    urls: list[str],
    model: str,
    *,
    duration_s: float,
    workers: int,
    pause_after_refusal_s: float = 0.02,
    timeout_s: float = 30.0,
) -> Load:
    """``workers`` clients, round-robin over ``urls``, each sending one request at a time until
    ``duration_s`` has passed; a refused client waits ``pause_after_refusal_s`` before its next."""
    load = Load()
    body = {**BODY, "model": model}
    headers = {"Authorization": f"Bearer {KEY}"}
    connector = aiohttp.TCPConnector(limit=workers)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        load.started_at = time.monotonic()
        stop_at = load.started_at + duration_s

        async def worker(index: int) -> None:
            sent = index
            while time.monotonic() < stop_at:
                url = urls[sent % len(urls)] + "/v1/completions"
                sent += 1
                status = await one(session, url, body, headers, load)
                load.timeline.append((time.monotonic() - load.started_at, status))
                if status != 200:
                    await asyncio.sleep(pause_after_refusal_s)

        await asyncio.gather(*(worker(i) for i in range(workers)))
        load.ended_at = time.monotonic()
    return load


async def one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], load: Load
) -> int:
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            payload = await resp.json(content_type=None)
            status = resp.status
    except (aiohttp.ClientError, TimeoutError):
        load.statuses[-1] += 1
        return -1
    load.statuses[status] += 1
    if status == 200:
        usage = payload["usage"]
        load.admitted += 1
        load.charged += usage["prompt_tokens"] + 2 * usage["completion_tokens"]
        load.prompt_mismatches += usage["prompt_tokens"] != PROMPT_TOKENS
    else:
        load.codes[str((payload.get("error") or {}).get("code"))] += 1
    return status
