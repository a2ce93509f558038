"""``GET /v1/models`` takes a tenant's key when tenants are configured, as a completion does: a
wrong key fails there, so that an SDK's ``models.list()`` tells a client its key is wrong. With no
tenant configured it stays open. Real gateway, fake replica, real HTTP and the real ``openai`` SDK;
listing charges no budget and is not counted as a refused completion.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.tenants import AuthSettings
from tests.unit.gateway.fakes import MODEL
from tests.unit.tenancy.conftest import KEY_A, KEY_B, StartTenantGateway, bearer, tenancy_settings

MISSING = "You didn't provide an API key."
UNKNOWN = "Incorrect API key provided."
MALFORMED = "Malformed Authorization header"


@pytest.mark.parametrize(
    ("headers", "message", "challenge"),
    [
        pytest.param({}, MISSING, 'Bearer realm="sluice"', id="no-header"),
        pytest.param(
            bearer("sk-not-a-key-of-anyone"),
            UNKNOWN,
            'Bearer realm="sluice", error="invalid_token"',
            id="unknown",
        ),
        pytest.param(
            {"Authorization": "Basic dXNlcjpwYXNz"},
            MALFORMED,
            'Bearer realm="sluice", error="invalid_token"',
            id="basic",
        ),
    ],
)
async def test_a_missing_or_wrong_key_is_a_401_in_openai_shape(
    start_tenant_gateway: StartTenantGateway, headers: dict[str, str], message: str, challenge: str
) -> None:
    gw = await start_tenant_gateway()

    resp = await gw.client.get("/v1/models", headers=headers)

    assert resp.status == 401
    body = await resp.json()
    assert body["error"]["message"].startswith(message)
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (
        "invalid_request_error",
        None,
        "invalid_api_key",
    )
    assert resp.headers["WWW-Authenticate"] == challenge
    assert gw.outcomes == []  # not a completion: the request metrics do not count it


@pytest.mark.parametrize("key", [KEY_A, KEY_B])
async def test_a_tenants_key_lists_the_models(start_tenant_gateway: StartTenantGateway, key: str) -> None:
    gw = await start_tenant_gateway()

    resp = await gw.client.get("/v1/models", headers=bearer(key))

    assert resp.status == 200
    assert [card["id"] for card in (await resp.json())["data"]] == [MODEL]
    assert gw.tenancy.budget.settles_started == 0  # listing charges nothing


async def test_head_takes_a_key_too(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway()

    assert (await gw.client.head("/v1/models")).status == 401
    assert (await gw.client.head("/v1/models", headers=bearer(KEY_A))).status == 200


@pytest.mark.parametrize(
    "headers", [{}, bearer("EMPTY"), bearer("sk-anything")], ids=["none", "placeholder", "any"]
)
async def test_without_tenants_the_list_is_open(
    start_tenant_gateway: StartTenantGateway, headers: dict[str, str]
) -> None:
    gw = await start_tenant_gateway(settings=lambda url: tenancy_settings(url, with_tenants=False))

    resp = await gw.client.get("/v1/models", headers=headers)

    assert resp.status == 200
    assert [card["id"] for card in (await resp.json())["data"]] == [MODEL]


async def test_keys_optional_lists_for_no_key_but_not_for_a_wrong_one(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(
        settings=lambda url: tenancy_settings(url, auth=AuthSettings(anonymous_tenant="team-b"))
    )

    assert (await gw.client.get("/v1/models")).status == 200
    assert (await gw.client.get("/v1/models", headers=bearer("sk-wrong"))).status == 401


async def test_the_openai_sdk_tells_a_wrong_key_from_a_right_one(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway()
    base_url = str(gw.client.make_url("/v1"))

    def client(key: str) -> Any:
        return openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0)

    with pytest.raises(openai.AuthenticationError) as caught:
        await client("sk-not-a-key-of-anyone").models.list()
    listed = await client(KEY_A).models.list()

    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert [model.id for model in listed.data] == [MODEL]
