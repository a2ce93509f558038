"""Fixtures: fake replicas on free ports and a gateway in front of them (all real HTTP)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from aiohttp.test_utils import TestServer

from gateway.config.settings import Settings
from tests.unit.gateway.fakes import FakeReplica, Gateway, gateway_settings, make_app, url_of

StartReplica = Callable[[FakeReplica], Awaitable[tuple[TestServer, str]]]
StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
def start_replica(aiohttp_server) -> StartReplica:
    """Serve a ``FakeReplica`` on a free port; returns its server and base URL."""

    async def start(replica: FakeReplica) -> tuple[TestServer, str]:
        server = await aiohttp_server(replica.app())
        return server, await url_of(server)

    return start


@pytest.fixture
def start_gateway(aiohttp_client) -> StartGateway:
    """Build and start the gateway for ``replicas`` (name -> URL) or for given ``settings``."""

    async def start(replicas: dict[str, str] | None = None, *, settings: Settings | None = None) -> Gateway:
        chosen = settings if settings is not None else gateway_settings(replicas or {})
        app, store, outcomes = make_app(chosen)
        client = await aiohttp_client(app)
        return Gateway(client, app, store, outcomes)

    return start
