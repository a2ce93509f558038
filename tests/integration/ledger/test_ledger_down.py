"""A gateway whose ledger's Redis does not answer: it serves as a single gateway would, says so
once, shows it in its admin view and metrics, and widens every class's margin by
``ledger.unavailable_margin``."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.admission.live import ADMISSION
from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.support.procs import free_port

pytestmark = [pytest.mark.timeout(60)]

Client = TestClient[web.Request, web.Application]


async def test_ledger_down_means_local_view_wider_margins_one_line(
    aiohttp_server: Any, aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.ledger")
    emulator: TestServer = await aiohttp_server(build_emulator(load_profile("llama3-8b-h100"), seed=1))
    url = str(emulator.make_url("")).rstrip("/")
    settings = Settings.model_validate(
        {
            "replicas": [{"name": "r0", "url": url}],
            "health": {"interval_s": 30.0, "timeout_s": 5.0},
            "server": {"port": 0},
            # Nothing listens there: every ledger call fails at once.
            "limits": {"redis": {"url": f"redis://127.0.0.1:{free_port()}/0", "timeout_s": 0.2}},
            "ledger": {"enabled": True, "heartbeat_s": 0.1, "expiry_s": 0.3, "unavailable_margin": 0.5},
        }
    )
    client: Client = await aiohttp_client(build_app(SettingsStore(settings)))
    model = str((await (await client.get("/v1/models")).json())["data"][0]["id"])
    for _ in range(3):
        body = {"model": model, "prompt": "word " * 20, "max_tokens": 4}
        resp = await client.post("/v1/completions", json=body)
        await resp.read()
        assert resp.status == 200

    view = await (await client.get("/sluice/v1/replicas")).json()
    assert view["ledger"]["up"] is False
    assert view["ledger"]["replicas"] == {}
    text = await (await client.get("/metrics")).text()
    assert "sluice_ledger_up 0.0" in text
    # Every class's margin widened: (1 + forecast_margin) x 1.5 - 1 where none moved.
    engine = client.app[ADMISSION].engine
    margins = engine.view_cache.margins
    assert margins is not None
    widened = margins("r0", 0.0)
    assert set(widened) == set(engine.settings.classes)
    for margin in widened.values():
        assert margin == pytest.approx((1 + engine.settings.forecast_margin) * 1.5 - 1)
    downs = [r for r in caplog.records if "ledger unreachable" in r.getMessage()]
    assert len(downs) == 1
