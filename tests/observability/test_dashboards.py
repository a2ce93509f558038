"""Every Grafana panel's query, run against a real Prometheus scraping a real gateway and two
emulated vLLM replicas under load.

Setup (about 15-25 s): two ``python -m simulator`` processes; a real ``redis-server`` holding the
tenants' budgets (``limits.backend: redis``); the gateway in process (``build_app``, which installs
the metrics); Debian's ``prometheus`` with the shipped ``prometheus.yml`` and rules, its targets and
intervals rewritten for the test (1 s scrapes, discovery of the replicas through the gateway's
``/metrics/replicas``).

The configuration and the load are chosen so that every metric has a real producer at work:

* Two tenants with API keys and every budget. ``team-a``'s budgets are ample; ``team-b``'s request
  budget is one request per few seconds, so most of its requests get a 429 ``requests`` with a
  Retry-After, the later ones answered from the over-limit cache.
* Classes, with the SLO rule in shadow mode (``admission.shadow.slo``) and every other rule
  enforced. ``interactive`` has the default targets. ``strict`` has a TTFT target no replica can
  meet (1 ms): each of its requests is ``shadow_rejected`` (``slo_unattainable``), admitted anyway,
  and counted as ``missed_ttft``. ``capped`` may hold one decode slot per replica and never queues
  (``batch_isolation``, enforced): bursts of four concurrent requests get 429 ``overloaded`` with a
  Retry-After from the forecast of when a slot frees.
* ``team-a`` sends streamed chat, plain completions, requests no replica can hold (``max_tokens``
  over every context: Sluice answers 400 ``prompt_too_large``), ``strict`` streams and ``capped``
  bursts; ``team-b`` sends plain completions.
* Redis is frozen (SIGSTOP) for two seconds under that load: the limiter counts storage errors and
  fails open to its local buckets, then returns to Redis.

Then each panel target must parse (``/api/v1/query`` answers ``success``) and return at least one
finite sample, except those in ``PENDING`` (none today): a panel whose metric has no producer yet
must parse and return nothing. When a feature lands and its panels get data, this test fails and
names the entries to delete from ``PENDING``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.admission.config import AdmissionSettings, ClassSettings, HeaderSettings, ShadowSettings
from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.limits.config import LimitsSettings, RedisSettings, TenantLimitSettings
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings
from gateway.tenants.config import TenantSettings, TenantsSettings
from gateway.tenants.keys import hash_api_key
from tests.observability.prometheus import CONFIG, DASHBOARDS, RULES, tool
from tests.support.procs import Proc, free_port, python_module
from tests.support.redis import RedisServer, redis_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: (dashboard uid, panel title, refId) -> why it has no data yet. Add an entry when a panel is added
#: before its producer; delete it when the feature lands (the test says which).
PENDING: dict[tuple[str, str, str], str] = {}

#: Grafana's own variables, as the test substitutes them (All = ``.*``).
SUBSTITUTIONS = {"$__rate_interval": "1m", "$class": ".*", "$replica": ".*", "$tenant": ".*"}
PROFILE = "llama3-8b-h100"
#: What an operator would write for the emulated replicas (the profile's GPU, model and limits).
H100_LLAMA3_8B = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
#: Seconds to keep retrying until every expected query returns data (rates need two scrapes).
SETTLE_TIMEOUT_S = 60.0

TEAM_A, TEAM_B = "team-a", "team-b"
API_KEYS = {TEAM_A: "sk-dashboards-team-a", TEAM_B: "sk-dashboards-team-b"}
INTERACTIVE, STRICT, CAPPED = "interactive", "strict", "capped"
#: Concurrent requests per ``capped`` burst: two more than its one decode slot on each replica.
BURST = 4
CLASS_HEADER = HeaderSettings().request_class
#: Seconds Redis is frozen (SIGSTOP) mid-test: the limiter fails open to its local buckets.
REDIS_OUTAGE_S = 2.0
#: What the Redis outage must leave behind, whatever the rate panels show at the end.
AFTER_OUTAGE = ("sum(sluice_redis_errors_total)", "sum(sluice_redis_fail_open_total)")


def _settings(replica_ports: dict[str, int], redis_url: str) -> Settings:
    """Replicas, tenants, classes and limits of the scenario described in the module docstring."""
    classes = {
        INTERACTIVE: ClassSettings(),
        # Below any replica's first token: admitted (the SLO rule is in shadow), then missed.
        STRICT: ClassSettings(ttft_target_s=0.001, max_queue_wait_s=0.0),
        # One decode slot per replica (max(1, floor(share x slots))), and no queueing: a third
        # concurrent request is refused at once.
        CAPPED: ClassSettings(slot_share=0.001, max_queue_wait_s=0.0),
    }
    ample = TenantLimitSettings(
        tokens_per_minute=10_000_000.0, requests_per_minute=100_000.0, max_concurrent=64
    )
    scarce = TenantLimitSettings(
        tokens_per_minute=1_000_000.0, requests_per_minute=20.0, request_burst=1, max_concurrent=4
    )
    tenants = {
        TEAM_A: TenantSettings(api_keys=[hash_api_key(API_KEYS[TEAM_A])], weight=2.0, limits=ample),
        TEAM_B: TenantSettings(
            api_keys=[hash_api_key(API_KEYS[TEAM_B])], limits=scarce, allowed_classes=[INTERACTIVE]
        ),
    }
    return Settings(
        replicas=[
            ReplicaSettings(name=n, url=f"http://127.0.0.1:{p}", hardware=H100_LLAMA3_8B)
            for n, p in replica_ports.items()
        ],
        health=HealthSettings(interval_s=1.0, timeout_s=0.5),
        server=ServerSettings(port=0),
        admission=AdmissionSettings(
            classes=classes, default_class=INTERACTIVE, shadow=ShadowSettings(slo=True)
        ),
        tenants=TenantsSettings(tenants=tenants),
        # A generous Redis timeout: on a loaded machine, only the deliberate outage should fail open.
        limits=LimitsSettings(backend="redis", redis=RedisSettings(url=redis_url, timeout_s=0.5)),
    )


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
async def _gateway(settings: Settings) -> AsyncIterator[int]:
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


@dataclass
class Traffic:
    """What the load got back: (sender, status) -> responses; sender -> 429s with a Retry-After."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    retry_after: Counter[str] = field(default_factory=Counter)

    async def send(
        self,
        session: aiohttp.ClientSession,
        sender: str,
        path: str,
        body: dict[str, Any],
        cls: str | None = None,
    ) -> None:
        headers = {} if cls is None else {CLASS_HEADER: cls}
        async with session.post(path, json=body, headers=headers) as resp:
            await resp.read()
        self.statuses[sender, resp.status] += 1
        if resp.status == 429 and "Retry-After" in resp.headers:
            self.retry_after[sender] += 1


def _chat(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Describe admission control in two lines."}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


def _client(base: str, tenant: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base_url=base, headers={"Authorization": f"Bearer {API_KEYS[tenant]}"})


async def _steady(base: str, model: str, traffic: Traffic) -> None:
    """team-a, one request at a time: streamed chat, a plain completion, one too large for any
    replica, and a ``strict`` stream (shadow-rejected, then a TTFT miss)."""
    plain = {"model": model, "prompt": "Hello there", "max_tokens": 8}
    too_long = {"model": model, "prompt": "Hello", "max_tokens": 10_000_000}
    async with _client(base, TEAM_A) as session:
        while True:
            await traffic.send(session, "steady", "/v1/chat/completions", _chat(model, 24))
            await traffic.send(session, "steady", "/v1/chat/completions", _chat(model, 24))
            await traffic.send(session, "steady", "/v1/completions", plain)
            await traffic.send(session, "steady", "/v1/completions", too_long)
            await traffic.send(session, STRICT, "/v1/chat/completions", _chat(model, 16), STRICT)
            await asyncio.sleep(0.05)


async def _bursts(base: str, model: str, traffic: Traffic) -> None:
    """team-a, ``capped``: BURST concurrent streams at a time, more than the class's slots."""
    async with _client(base, TEAM_A) as session:
        while True:
            await asyncio.gather(
                *(
                    traffic.send(session, CAPPED, "/v1/chat/completions", _chat(model, 48), CAPPED)
                    for _ in range(BURST)
                )
            )
            await asyncio.sleep(0.2)


async def _over_budget(base: str, model: str, traffic: Traffic) -> None:
    """team-b: plain completions faster than its request budget refills."""
    plain = {"model": model, "prompt": "Hello from team b", "max_tokens": 8}
    async with _client(base, TEAM_B) as session:
        while True:
            await traffic.send(session, TEAM_B, "/v1/completions", plain)
            await asyncio.sleep(0.25)


async def _load(base: str, model: str, traffic: Traffic) -> None:
    """Every sender at once, until cancelled."""
    await asyncio.gather(
        _steady(base, model, traffic), _bursts(base, model, traffic), _over_budget(base, model, traffic)
    )


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
    """The first model the gateway lists, once a health check has found a replica healthy (on a
    loaded machine the first checks can time out)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    headers = {"Authorization": f"Bearer {API_KEYS[TEAM_A]}"}  # the list needs a tenant's key
    async with aiohttp.ClientSession(headers=headers) as session:
        while True:
            async with session.get(f"{base}/v1/models") as resp:
                data = (await resp.json())["data"]
            if data:
                return str(data[0]["id"])
            assert time.monotonic() < deadline, "the gateway lists no model"
            await asyncio.sleep(0.2)


async def test_every_panel_query_parses_and_returns_data(tmp_path: Path) -> None:
    queries = panel_queries()
    expected = [q for q in queries if q.key not in PENDING]
    pending = [q for q in queries if q.key in PENDING]
    assert len(expected) >= 30
    traffic = Traffic()
    with redis_server() as redis, _emulators(2) as ports:
        async with _gateway(_settings(ports, redis.url)) as gateway_port:
            base = f"http://127.0.0.1:{gateway_port}"
            load = asyncio.create_task(_load(base, await _model(base), traffic))
            try:
                with _prometheus(tmp_path, gateway_port) as prom:
                    await _redis_outage(redis)
                    missing = await _settle(prom, expected)
                    not_counted = await _settle_positive(prom, AFTER_OUTAGE)
                    empty_variables = await _variables_without_values(prom)
                    wrongly_pending = await _pending_with_data(prom, pending)
            finally:
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load
    seen = (
        f"responses (sender, status): {dict(traffic.statuses)}; with Retry-After: {dict(traffic.retry_after)}"
    )
    assert missing == [], "panels without data:\n" + "\n".join(missing) + "\n" + seen
    assert not_counted == [], f"the Redis outage was not counted: {not_counted}\n{seen}"
    assert empty_variables == [], f"dashboard variables without values: {empty_variables}"
    assert wrongly_pending == [], "these now return data; delete them from PENDING:\n" + "\n".join(
        wrongly_pending
    )
    # The scenario did what the module docstring says (the panels above show it too).
    assert traffic.retry_after[CAPPED] > 0, seen
    assert traffic.retry_after[TEAM_B] > 0, seen
    assert traffic.statuses[STRICT, 200] > 0, seen


async def _redis_outage(redis: RedisServer) -> None:
    """Freeze Redis for REDIS_OUTAGE_S under load (a real hang: the server keeps its sockets open
    and answers nothing), then let it answer again."""
    await asyncio.sleep(1.0)
    redis.pause()
    try:
        await asyncio.sleep(REDIS_OUTAGE_S)
    finally:
        redis.resume()


async def _settle_positive(prom: str, exprs: tuple[str, ...]) -> list[str]:
    """Retry until every query in ``exprs`` returns a value above 0 (or the deadline); the others."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while True:
            low = []
            for expr in exprs:
                body = await _query(session, prom, expr)
                result = body["data"]["result"]
                if not result or not float(result[0]["value"][1]) > 0:
                    low.append(f"{expr} = {result}")
            if not low or time.monotonic() > deadline:
                return low
            await asyncio.sleep(1.0)


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
