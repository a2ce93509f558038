"""The admin surface on a real gateway app in front of a real (fake) replica over HTTP: the token
on the shared listener, the separate admin listener (a real second socket), public probes, token
reloads, and the token kept out of bodies and logs."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.config.settings import AdminSettings, Settings
from gateway.config.store import SettingsStore
from gateway.http.admin import ADMIN_LISTENER, AdminGuard, AdminListener
from gateway.observability.log_format import JsonFormatter, TextFormatter
from gateway.tenants import AuthSettings, TenantsSettings, hash_api_key
from tests.support.procs import port_is_open
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import FakeReplica, gateway_settings

TOKEN = "sluice-admin-token-0123456789"
OTHER_TOKEN = "sluice-admin-token-rotated-42"
TOKEN_HEX = hashlib.sha256(TOKEN.encode()).hexdigest()
ADMIN_PATHS = ["/metrics", "/metrics/replicas", "/sluice/v1/replicas"]


def with_admin(settings: Settings, **admin: Any) -> Settings:
    return settings.model_copy(update={"admin": AdminSettings(**admin)})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_admin_401(body: dict[str, Any], headers: Any, *, sent: str | None) -> None:
    """The OpenAI-style 401 of an admin route, which never echoes what was sent."""
    assert body == {
        "error": {
            "message": "This endpoint needs the admin token: Authorization: Bearer <admin token> "
            "(admin.token_sha256, or tenants.auth.admin_token_hash).",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_admin_token",
        }
    }
    assert headers["WWW-Authenticate"] == 'Bearer realm="sluice-admin"'
    assert headers["x-request-id"]
    if sent is not None:
        assert sent not in str(body)
        assert sent not in str(dict(headers))


@pytest.fixture
async def replica_url(start_replica: StartReplica) -> str:
    _, url = await start_replica(FakeReplica())
    return url


# -- one listener, with a token ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ADMIN_PATHS)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer sk-wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN_HEX}"],
    ids=["none", "wrong", "other-scheme", "longer", "the-hash-itself"],
)
async def test_token_is_required_on_the_shared_listener(
    start_gateway: StartGateway, replica_url: str, path: str, authorization: str | None
) -> None:
    gw = await start_gateway(
        settings=with_admin(gateway_settings({"r0": replica_url}), token_sha256=TOKEN_HEX)
    )

    resp = await gw.client.get(
        path, headers={} if authorization is None else {"Authorization": authorization}
    )

    assert resp.status == 401
    sent = None if authorization is None else authorization.partition(" ")[2]
    assert_admin_401(await resp.json(), resp.headers, sent=sent)


async def test_right_token_opens_every_admin_route(start_gateway: StartGateway, replica_url: str) -> None:
    gw = await start_gateway(
        settings=with_admin(gateway_settings({"r0": replica_url}), token_sha256=TOKEN_HEX)
    )

    metrics = await gw.client.get("/metrics", headers=bearer(TOKEN))
    targets = await gw.client.get("/metrics/replicas", headers=bearer(TOKEN))
    # The scheme is case-insensitive (RFC 6750 / RFC 9110).
    replicas = await gw.client.get("/sluice/v1/replicas", headers={"Authorization": f"bearer {TOKEN}"})

    assert (metrics.status, targets.status, replicas.status) == (200, 200, 200)
    assert "sluice_" in await metrics.text()
    assert [t["labels"]["replica"] for t in await targets.json()] == ["r0"]
    assert "r0" in str(await replicas.json())


async def test_probes_and_the_api_stay_public_when_a_token_is_set(
    start_gateway: StartGateway, replica_url: str
) -> None:
    gw = await start_gateway(
        settings=with_admin(gateway_settings({"r0": replica_url}), token_sha256=TOKEN_HEX)
    )

    statuses = [(await gw.client.get(path)).status for path in ("/healthz", "/readyz", "/v1/models")]

    assert statuses == [200, 200, 200]


async def test_no_token_configured_keeps_todays_open_admin_routes(
    start_gateway: StartGateway, replica_url: str
) -> None:
    gw = await start_gateway({"r0": replica_url})

    statuses = [(await gw.client.get(path)).status for path in ADMIN_PATHS]

    assert statuses == [200, 200, 200]
    assert ADMIN_LISTENER not in gw.app


async def test_token_change_takes_effect_on_reload_without_restart(
    start_gateway: StartGateway, replica_url: str
) -> None:
    base = gateway_settings({"r0": replica_url})
    gw = await start_gateway(settings=with_admin(base, token_sha256=TOKEN_HEX))
    assert (await gw.client.get("/metrics", headers=bearer(TOKEN))).status == 200

    gw.store.swap(with_admin(base, token_sha256=hash_api_key(OTHER_TOKEN)))
    rotated = [(await gw.client.get("/metrics", headers=bearer(t))).status for t in (TOKEN, OTHER_TOKEN)]
    gw.store.swap(base)
    opened = (await gw.client.get("/metrics")).status

    assert rotated == [401, 200]
    assert opened == 200


#: Spellings of the admin paths a router or a proxy might normalise differently from the guard.
TRICKY_PATHS = [
    "/metrics/",
    "//metrics",
    "/./metrics",
    "/v1/../metrics",
    "/healthz/../metrics",
    "/%6detrics",
    "/metrics%2F",
    "/metrics;x",
    "/Metrics",
    "/metrics/replicas/../replicas",
    "/sluice/v1/replicas/",
    "/sluice//v1/replicas",
    "/sluice/v1/./replicas",
    "/%73luice/v1/replicas",
]


async def raw_status(port: int, path: str) -> int:
    """The status of ``GET path`` sent byte for byte (no client-side normalisation)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return int(status_line.split()[1])


@pytest.mark.parametrize("admin", [{"token_sha256": TOKEN_HEX}, {"port": 0}], ids=["token", "admin-port"])
async def test_no_spelling_of_an_admin_path_gets_past_the_guard(
    start_gateway: StartGateway, replica_url: str, admin: dict[str, Any]
) -> None:
    gw = await start_gateway(settings=with_admin(gateway_settings({"r0": replica_url}), **admin))
    port = gw.client.port
    assert port is not None

    statuses = {path: await raw_status(port, path) for path in TRICKY_PATHS}

    assert {path: status for path, status in statuses.items() if status not in (401, 404)} == {}


def test_guard_follows_the_older_tenants_admin_token_hash() -> None:
    tenants = TenantsSettings(auth=AuthSettings(admin_token_hash=hash_api_key(TOKEN)))
    store = SettingsStore(
        gateway_settings({"r0": "http://127.0.0.1:1"}).model_copy(update={"tenants": tenants})
    )
    guard = AdminGuard(store)

    assert guard.token_required
    assert [guard.allowed(v) for v in (None, f"Bearer {TOKEN}", "Bearer nope", "Bearer")] == [
        False,
        True,
        False,
        False,
    ]
    assert TOKEN not in repr(guard)
    assert TOKEN_HEX not in repr(guard)


# -- a separate admin listener -----------------------------------------------------------------------


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, CIMultiDict[str]]:
    """GET ``url`` on its own connection: status, body text, headers (case-insensitive)."""
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers or {}) as resp:
        return resp.status, await resp.text(), resp.headers.copy()


async def test_admin_port_moves_admin_routes_off_the_public_listener(
    start_gateway: StartGateway, replica_url: str
) -> None:
    gw = await start_gateway(settings=with_admin(gateway_settings({"r0": replica_url}), port=0))
    listener = gw.app[ADMIN_LISTENER]
    assert listener.port is not None
    assert listener.port != gw.client.port

    public = [await gw.client.get(path) for path in ADMIN_PATHS]
    admin = [await _get(listener.url + path) for path in ADMIN_PATHS]
    public_probes = [(await gw.client.get(path)).status for path in ("/healthz", "/readyz")]
    admin_non_admin = [(await _get(listener.url + path))[0] for path in ("/healthz", "/v1/models")]

    assert [r.status for r in public] == [404, 404, 404]
    for resp in public:
        assert (await resp.json())["error"]["code"] == "not_found"
    assert [status for status, _, _ in admin] == [200, 200, 200]
    assert "sluice_" in admin[0][1]
    assert '"replica": "r0"' in admin[1][1]
    assert "r0" in admin[2][1]
    assert all(headers.get("x-request-id") for _, _, headers in admin)
    assert public_probes == [200, 200]
    assert admin_non_admin == [404, 404]


async def test_admin_listener_with_token(start_gateway: StartGateway, replica_url: str) -> None:
    gw = await start_gateway(
        settings=with_admin(gateway_settings({"r0": replica_url}), port=0, token_sha256=TOKEN_HEX)
    )
    url = gw.app[ADMIN_LISTENER].url

    refused = [await _get(url + path, bearer("sk-wrong")) for path in ADMIN_PATHS]
    allowed = [(await _get(url + path, bearer(TOKEN)))[0] for path in ADMIN_PATHS]
    # The public listener answers 404 even to the right token: the routes are not there.
    public = [(await gw.client.get(path, headers=bearer(TOKEN))).status for path in ADMIN_PATHS]

    assert [status for status, _, _ in refused] == [401, 401, 401]
    for _, text, headers in refused:
        assert_admin_401(json.loads(text), headers, sent="sk-wrong")
    assert allowed == [200, 200, 200]
    assert public == [404, 404, 404]


async def test_public_404_wins_over_the_older_tenants_admin_token(
    start_gateway: StartGateway, replica_url: str
) -> None:
    """``tenants.auth.admin_token_hash`` guards the admin listener; the public one answers 404
    first (the tenants' own admin check never runs there)."""
    tenants = TenantsSettings(auth=AuthSettings(admin_token_hash=hash_api_key(TOKEN)))
    settings = with_admin(gateway_settings({"r0": replica_url}), port=0).model_copy(
        update={"tenants": tenants}
    )
    gw = await start_gateway(settings=settings)
    url = gw.app[ADMIN_LISTENER].url

    assert (await gw.client.get("/metrics")).status == 404
    assert (await _get(url + "/metrics"))[0] == 401
    assert (await _get(url + "/metrics", bearer(TOKEN)))[0] == 200


async def test_admin_listener_stops_with_the_gateway(start_gateway: StartGateway, replica_url: str) -> None:
    gw = await start_gateway(settings=with_admin(gateway_settings({"r0": replica_url}), port=0))
    listener = gw.app[ADMIN_LISTENER]
    port = listener.port
    assert port is not None
    # A whole request (not a bare connect, which could be accepted mid-shutdown and leak).
    assert (await _get(listener.url + "/metrics"))[0] == 200

    await gw.client.close()

    assert not port_is_open(port)
    assert listener.port is None


async def test_admin_port_in_use_fails_naming_the_admin_address(
    start_gateway: StartGateway, replica_url: str
) -> None:
    first = await start_gateway(settings=with_admin(gateway_settings({"r0": replica_url}), port=0))
    taken = first.app[ADMIN_LISTENER].port
    assert taken is not None
    second = AdminListener(SettingsStore(first.store.current), "127.0.0.1", taken)

    with pytest.raises(OSError, match=f"admin listener on 127.0.0.1:{taken}: ") as caught:
        await second.start()

    assert caught.value.errno == errno.EADDRINUSE
    assert second.port is None


# -- secrets -----------------------------------------------------------------------------------------


async def test_token_never_reaches_logs_metrics_or_bodies(
    start_gateway: StartGateway, replica_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    gw = await start_gateway(
        settings=with_admin(gateway_settings({"r0": replica_url}), token_sha256=TOKEN_HEX)
    )

    bodies = [await (await gw.client.get("/metrics", headers=bearer(t))).text() for t in (TOKEN, "sk-guess")]
    bodies.append(await (await gw.client.get("/sluice/v1/replicas", headers=bearer(TOKEN))).text())

    secrets = [TOKEN, TOKEN_HEX, "sk-guess"]
    text, json_lines = TextFormatter(), JsonFormatter()
    logged = "\n".join(text.format(r) + json_lines.format(r) for r in caplog.records)
    assert "access" in logged  # the access lines of the admin requests were captured
    assert [s for s in secrets if s in logged or any(s in body for body in bodies)] == []
