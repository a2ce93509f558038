"""Every Grafana panel's query, run against a real Prometheus scraping a real gateway and two
emulated vLLM replicas under light load.

Setup (about 15-25 s): two ``python -m simulator`` processes; the gateway in process
(``build_app`` + ``metrics.install``); Debian's ``prometheus`` with the shipped
``prometheus.yml`` and rules, its targets and intervals rewritten for the test (1 s scrapes,
discovery of the replicas through the gateway's ``/metrics/replicas``). A load task sends
streamed chat, plain completions and requests the replica rejects (``max_tokens`` over its
context).

Then each panel target must parse (``/api/v1/query`` answers ``success``) and return at least
one finite sample, except those in ``PENDING``: their metrics have no producer yet, so they must
parse and return nothing. When a feature lands and its panels get data, this test fails and
names the entries to delete from ``PENDING``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.app import build_app
from gateway.settings import HardwareSettings, HealthSettings, ReplicaSettings, ServerSettings, Settings
from gateway.store import SettingsStore
from tests.observability.prometheus import CONFIG, DASHBOARDS, RULES, tool
from tests.support.procs import Proc, free_port, python_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ADMISSION = (
    "this test's light load meets every target and runs no rule in shadow mode: no SLO miss, no shadow "
    "decision, and no load rejection with a Retry-After (tests/integration/admission produces them)"
)
TENANTS = "tenants and the limiter are not wired: no reservations, settles or LimiterStats (issue 5)"

#: (dashboard uid, panel title, refId) -> why it has no data yet. Delete entries as features land.
PENDING: dict[tuple[str, str, str], str] = {
    ("sluice-overview", "Shadow-mode rejections", "A"): ADMISSION,
    ("sluice-overview", "SLO misses by kind", "A"): ADMISSION,
    ("sluice-overview", "Retry-After given", "A"): ADMISSION,
    ("sluice-overview", "Retry-After given", "B"): ADMISSION,
    ("sluice-tenants", "Token budget: used vs limit", "A"): TENANTS,
    ("sluice-tenants", "Token budget: used vs limit", "B"): TENANTS,
    ("sluice-tenants", "Token bucket level", "A"): TENANTS,
    ("sluice-tenants", "Request bucket level", "A"): TENANTS,
    ("sluice-tenants", "Fair share of tokens", "A"): TENANTS,
    ("sluice-tenants", "Reserved vs settled tokens", "A"): TENANTS,
    ("sluice-tenants", "Reserved vs settled tokens", "B"): TENANTS,
    ("sluice-tenants", "Concurrent requests vs limit", "A"): TENANTS,
    ("sluice-tenants", "Concurrent requests vs limit", "B"): TENANTS,
}

#: Grafana's own variables, as the test substitutes them (All = ``.*``).
SUBSTITUTIONS = {"$__rate_interval": "1m", "$class": ".*", "$replica": ".*", "$tenant": ".*"}
PROFILE = "llama3-8b-h100"
#: What an operator would write for the emulated replicas (the profile's GPU, model and limits).
H100_LLAMA3_8B = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
#: Seconds to keep retrying until every expected query returns data (rates need two scrapes).
SETTLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.dashboard, self.panel, self.ref_id)


def _expand(expr: str) -> str:
    for variable, value in SUBSTITUTIONS.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def _dashboards() -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))]


def panel_queries() -> list[Query]:
    return [
        Query(board["uid"], panel["title"], target["refId"], _expand(target["expr"]))
        for board in _dashboards()
        for panel in board["panels"]
        for target in panel["targets"]
    ]


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, metric, label) of every ``label_values(metric, label)`` variable."""
    found = []
    for board in _dashboards():
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                inner = variable["definition"].removeprefix("label_values(").removesuffix(")")
                metric, label = (part.strip() for part in inner.split(","))
                found.append((board["uid"], metric, label))
    return found


def test_pending_entries_name_real_panel_targets() -> None:
    keys = {q.key for q in panel_queries()}
    assert set(PENDING) - keys == set(), "PENDING names targets that no dashboard has"


# -- the stack -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _emulators(count: int) -> Iterator[dict[str, int]]:
    ports = {f"emu-{i}": free_port() for i in range(count)}
    procs = [
        Proc(
            python_module("simulator", "--profile", PROFILE, "--port", str(port), "--seed", str(i + 1)),
            name=name,
        )
        for i, (name, port) in enumerate(ports.items())
    ]
    try:
        for proc, port in zip(procs, ports.values(), strict=True):
            proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        yield ports
    finally:
        for proc in procs:
            proc.stop()


@contextlib.asynccontextmanager
async def _gateway(replica_ports: dict[str, int]) -> AsyncIterator[int]:
    settings = Settings(
        replicas=[
            ReplicaSettings(name=n, url=f"http://127.0.0.1:{p}", hardware=H100_LLAMA3_8B)
            for n, p in replica_ports.items()
        ],
        health=HealthSettings(interval_s=1.0, timeout_s=0.5),
        server=ServerSettings(port=0),
    )
    app = build_app(SettingsStore(settings), spawn_emulators=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield port
    finally:
        await runner.cleanup()


def _prometheus_config(gateway_port: int, prometheus_port: int) -> dict[str, Any]:
    """The shipped prometheus.yml with local targets, 1 s intervals and absolute rule paths."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(path) for path in RULES]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"sluice", "replicas", "prometheus"}
    jobs["sluice"]["static_configs"] = [{"targets": [f"127.0.0.1:{gateway_port}"]}]
    (discovery,) = jobs["replicas"]["http_sd_configs"]
    assert discovery["url"].endswith("/metrics/replicas")
    discovery.update(url=f"http://127.0.0.1:{gateway_port}/metrics/replicas", refresh_interval="1s")
    jobs["prometheus"]["static_configs"] = [{"targets": [f"127.0.0.1:{prometheus_port}"]}]
    return config


@contextlib.contextmanager
def _prometheus(tmp_path: Path, gateway_port: int) -> Iterator[str]:
    port = free_port()
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(_prometheus_config(gateway_port, port)))
    proc = Proc(
        [
            tool("prometheus"),
            f"--config.file={config_path}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            "--log.level=warn",
        ],
        name="prometheus",
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()
        print(proc.output()[-4000:])


async def _load(base: str, model: str) -> None:
    """Light, steady traffic: streamed chat, a plain completion, and one the replica rejects."""
    async with aiohttp.ClientSession(base_url=base) as session:
        while True:
            chat = {
                "model": model,
                "messages": [{"role": "user", "content": "Describe admission control in two lines."}],
                "max_tokens": 24,
                "stream": True,
                "ignore_eos": True,
            }
            plain = {"model": model, "prompt": "Hello there", "max_tokens": 8}
            too_long = {"model": model, "prompt": "Hello", "max_tokens": 10_000_000}
            for body, path in ((chat, "/v1/chat/completions"), (chat, "/v1/chat/completions"),
                               (plain, "/v1/completions"), (too_long, "/v1/completions")):  # fmt: skip
                async with session.post(path, json=body) as resp:
                    await resp.read()
            await asyncio.sleep(0.05)


async def _query(session: aiohttp.ClientSession, prom: str, expr: str) -> dict[str, Any]:
    async with session.get(f"{prom}/api/v1/query", params={"query": expr}) as resp:
        body: dict[str, Any] = await resp.json()
        return body


def _finite_samples(body: dict[str, Any]) -> int:
    data = body["data"]
    if data["resultType"] == "scalar":
        return int(math.isfinite(float(data["result"][1])))
    return sum(1 for series in data["result"] if math.isfinite(float(series["value"][1])))


async def _wait_until_ready(session: aiohttp.ClientSession, prom: str, deadline: float) -> None:
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"{prom}/-/ready") as resp:
                if resp.status == 200:
                    return
        assert time.monotonic() < deadline, "prometheus did not become ready"
        await asyncio.sleep(0.2)


async def _model(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as resp:
        data = (await resp.json())["data"]
    assert data, "the gateway lists no model"
    return str(data[0]["id"])


async def test_every_panel_query_parses_and_returns_data(tmp_path: Path) -> None:
    queries = panel_queries()
    expected = [q for q in queries if q.key not in PENDING]
    pending = [q for q in queries if q.key in PENDING]
    assert len(expected) >= 30
    with _emulators(2) as ports:
        async with _gateway(ports) as gateway_port:
            base = f"http://127.0.0.1:{gateway_port}"
            load = asyncio.create_task(_load(base, await _model(base)))
            try:
                with _prometheus(tmp_path, gateway_port) as prom:
                    missing = await _settle(prom, expected)
                    empty_variables = await _variables_without_values(prom)
                    wrongly_pending = await _pending_with_data(prom, pending)
            finally:
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load
    assert missing == [], "panels without data:\n" + "\n".join(missing)
    assert empty_variables == [], f"dashboard variables without values: {empty_variables}"
    assert wrongly_pending == [], "these now return data; delete them from PENDING:\n" + "\n".join(
        wrongly_pending
    )


async def _settle(prom: str, expected: list[Query]) -> list[str]:
    """Retry until every expected query returns a finite sample (or the deadline); the misses."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        await _wait_until_ready(session, prom, deadline)
        remaining = list(expected)
        while True:
            still: list[Query] = []
            problems: list[str] = []
            for query in remaining:
                body = await _query(session, prom, query.expr)
                assert body["status"] == "success", f"{query.key} does not parse: {body}\n{query.expr}"
                if _finite_samples(body) == 0:
                    still.append(query)
                    problems.append(f"{query.key}: {query.expr}")
            remaining = still
            if not remaining or time.monotonic() > deadline:
                return problems
            await asyncio.sleep(1.0)


async def _variables_without_values(prom: str) -> list[tuple[str, str, str]]:
    empty = []
    async with aiohttp.ClientSession() as session:
        for uid, metric, label in variable_queries():
            async with session.get(f"{prom}/api/v1/label/{label}/values", params={"match[]": metric}) as resp:
                body = await resp.json()
            assert body["status"] == "success", body
            if not body["data"]:
                empty.append((uid, metric, label))
    return empty


async def _pending_with_data(prom: str, pending: list[Query]) -> list[str]:
    found = []
    async with aiohttp.ClientSession() as session:
        for query in pending:
            body = await _query(session, prom, query.expr)
            assert body["status"] == "success", f"{query.key} does not parse: {body}\n{query.expr}"
            if _finite_samples(body) > 0:
                found.append(f"{query.key} ({PENDING[query.key]})")
    return found
