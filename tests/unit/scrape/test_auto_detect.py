"""``backend: auto``: the scraper detects a replica's engine over real HTTP and logs it once.

Each replica is a real aiohttp server on a free port. The TGI body is built from the reference's
metric list (``tests/unit/scrape/tgi_text.py``: no real TGI scrape exists); the SGLang info body
carries the ``/get_server_info`` fields the reference names.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.replicas.scraper import MetricsScraper
from gateway.replicas.snapshot import ReplicaSnapshot
from tests.unit.scrape.scrapes import REAL_032, fixture_text
from tests.unit.scrape.tgi_text import TgiState, tgi_exposition

TIMEOUT_S = 10.0


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _app(metrics: str | None = None, info: tuple[str, dict[str, object]] | None = None) -> web.Application:
    app = web.Application()
    if metrics is not None:
        text = metrics

        async def handle_metrics(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/plain")

        app.router.add_get("/metrics", handle_metrics)
    if info is not None:
        path, body = info

        async def handle_info(request: web.Request) -> web.Response:
            return web.json_response(body)

        app.router.add_get(path, handle_info)
    return app


async def _scrape_twice(
    session: aiohttp.ClientSession, url: str, engines: list[str] | None = None
) -> tuple[MetricsScraper, list[ReplicaSnapshot]]:
    scraper = MetricsScraper(session, timeout_s=TIMEOUT_S)
    scraper.add_replica("r1", url, dialect="auto", on_engine=None if engines is None else engines.append)
    snapshots = [await scraper.scrape_once("r1"), await scraper.scrape_once("r1")]
    return scraper, snapshots


@pytest.mark.parametrize(
    ("body", "engine"),
    [(fixture_text(REAL_032), "vllm"), (tgi_exposition(TgiState()), "tgi")],
    ids=["vllm", "tgi"],
)
async def test_engine_detected_from_metrics_and_logged_once(
    aiohttp_server, session, caplog, body: str, engine: str
) -> None:
    server = await aiohttp_server(_app(metrics=body))
    caplog.set_level(logging.INFO, logger="sluice.scraper")
    told: list[str] = []

    scraper, snapshots = await _scrape_twice(session, str(server.make_url("/")), told)

    assert scraper.engine("r1") == engine
    assert told == [engine]  # the callback runs once, not at every scrape
    assert all(not s.stale and s.dialect == engine for s in snapshots)
    detected = [r.getMessage() for r in caplog.records if "detected engine" in r.getMessage()]
    assert detected == [f"replica r1: detected engine {engine} from /metrics"]


async def test_sglang_without_metrics_is_detected_from_get_server_info(
    aiohttp_server, session, caplog
) -> None:
    """SGLang serves no /metrics without --enable-metrics: its server info still names it."""
    info: dict[str, object] = {
        "model_path": "meta-llama/Llama-3.1-8B",
        "tp_size": 1,
        "max_total_num_tokens": 9,
    }
    server = await aiohttp_server(_app(info=("/get_server_info", info)))
    caplog.set_level(logging.INFO, logger="sluice.scraper")

    scraper, snapshots = await _scrape_twice(session, str(server.make_url("/")))

    assert scraper.engine("r1") == "sglang"
    last = snapshots[-1]
    assert last.stale
    assert last.dialect == "sglang"
    assert "GET /metrics answered 404" in str(last.stale_reason)
    detected = [r.getMessage() for r in caplog.records if "detected engine" in r.getMessage()]
    assert detected == ["replica r1: detected engine sglang from GET /get_server_info"]


async def test_tgi_info_identifies_tgi_when_metrics_say_nothing(aiohttp_server, session) -> None:
    info: dict[str, object] = {
        "model_id": "m",
        "max_concurrent_requests": 128,
        "max_total_tokens": 4096,
        "router": "text-generation-router",
    }
    only_process = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n"
    server = await aiohttp_server(_app(metrics=only_process, info=("/info", info)))

    scraper, snapshots = await _scrape_twice(session, str(server.make_url("/")))

    assert scraper.engine("r1") == "tgi"
    assert snapshots[-1].stale
    assert "no tgi metric" in str(snapshots[-1].stale_reason)


async def test_undetectable_replica_stays_stale_and_unknown(aiohttp_server, session) -> None:
    server = await aiohttp_server(_app(metrics="# nothing here\n"))

    scraper, snapshots = await _scrape_twice(session, str(server.make_url("/")))

    assert scraper.engine("r1") is None
    for snapshot in snapshots:
        assert snapshot.stale
        assert snapshot.dialect is None
        assert "engine not detected yet" in str(snapshot.stale_reason)
