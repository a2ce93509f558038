"""A replica started with ``--api-key`` (vLLM, SGLang) gets its key on every request Sluice sends.

The fake replica refuses ``/v1/*`` and ``/metrics`` without ``Authorization: Bearer r-secret``
(``/health`` stays open, as vLLM's does), like vLLM's API-key middleware: without the key its
model list answers 401 and it never becomes healthy. A fake, because the emulator has no API key.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError

from gateway.keys import REGISTRY
from gateway.replicas.config import ReplicaSettings
from gateway.replicas.registry import ReplicaState
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings

KEY = "r-secret"
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class KeyedReplica(FakeReplica):
    """A ``FakeReplica`` behind vLLM's ``--api-key`` check; remembers what each path was sent."""

    authorizations: list[tuple[str, str | None]]

    def app(self) -> web.Application:
        self.authorizations = []

        @web.middleware
        async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
            sent = request.headers.get("Authorization")
            self.authorizations.append((request.path, sent))
            if request.path != "/health" and sent != f"Bearer {KEY}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            response: web.StreamResponse = await handler(request)
            return response

        app = super().app()
        app.middlewares.append(require_key)
        return app


async def test_the_replicas_own_key_goes_with_every_request(
    start_replica: StartReplica, start_gateway: StartGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_TEST_REPLICA_KEY", KEY)
    replica = KeyedReplica(metrics_text="# nothing yet\n")
    _, url = await start_replica(replica)
    settings = gateway_settings({"r1": url})
    keyed = ReplicaSettings(name="r1", url=url, api_key_env="SLUICE_TEST_REPLICA_KEY")
    gw = await start_gateway(settings=settings.model_copy(update={"replicas": [keyed]}))

    served = gw.app[REGISTRY].get("r1")
    assert served is not None
    assert served.state is ReplicaState.HEALTHY  # its /v1/models answered
    resp = await gw.client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client"})
    assert resp.status == 200, await resp.text()
    streamed = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert streamed.status == 200, await streamed.text()
    await streamed.read()

    refused = [
        (path, sent) for path, sent in replica.authorizations if path != "/health" and sent != f"Bearer {KEY}"
    ]
    assert refused == []
    paths = {path for path, _ in replica.authorizations}
    assert {"/v1/models", "/v1/chat/completions"} <= paths
    # The client's own key never reaches the replica.
    assert all(seen.headers.get("authorization") == f"Bearer {KEY}" for seen in replica.seen)


async def test_without_its_key_a_keyed_replica_never_serves(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """The failure the setting exists for, shown with the same fake: no key, no healthy replica."""
    replica = KeyedReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    described = gw.app[REGISTRY].get("r1")
    assert described is not None
    assert described.state is not ReplicaState.HEALTHY
    assert "401" in (described.last_error or "")


def test_an_unset_key_variable_refuses_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_TEST_MISSING_KEY", raising=False)
    with pytest.raises(ValidationError, match=r"api_key_env: names an environment variable that is unset"):
        ReplicaSettings(name="r1", url="http://127.0.0.1:9", api_key_env="SLUICE_TEST_MISSING_KEY")
    monkeypatch.setenv("SLUICE_TEST_MISSING_KEY", "")
    with pytest.raises(ValidationError, match=r"unset or empty"):
        ReplicaSettings(name="r1", url="http://127.0.0.1:9", api_key_env="SLUICE_TEST_MISSING_KEY")
