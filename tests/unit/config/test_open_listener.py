"""With no tenant configured Sluice authenticates no one: it then listens on loopback only,
unless ``server.allow_unauthenticated`` says otherwise (``sluice serve --allow-unauthenticated``)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.load import ConfigError, parse_settings
from gateway.tenants import demo_tenants

REPLICAS = [{"name": "a", "url": "http://10.0.0.5:8000"}]


def _data(server: dict[str, Any], *, tenants: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {"server": server, "replicas": REPLICAS}
    if tenants:
        data["tenants"] = demo_tenants().model_dump(mode="json", exclude_defaults=True)
    return data


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "10.0.0.7", "gateway.internal"])
def test_no_tenants_beyond_loopback_is_refused_naming_the_flag(host: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(_data({"host": host}), "sluice.yaml")

    (problem,) = caught.value.problems
    assert problem.startswith("server.host: no tenant is configured, so anyone who reaches this address")
    assert "server.allow_unauthenticated: true" in problem
    assert "--allow-unauthenticated" in problem
    assert problem.endswith(f"(got {host!r})")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_no_tenants_on_loopback_is_allowed(host: str) -> None:
    settings = parse_settings(_data({"host": host}), "sluice.yaml")

    assert settings.authenticates_no_one
    assert settings.server.loopback_only()


def test_allow_unauthenticated_opens_any_address() -> None:
    settings = parse_settings(_data({"host": "0.0.0.0", "allow_unauthenticated": True}), "sluice.yaml")

    assert settings.authenticates_no_one
    assert not settings.server.loopback_only()


def test_tenants_make_any_address_fine() -> None:
    settings = parse_settings(_data({"host": "0.0.0.0"}, tenants=True), "sluice.yaml")

    assert not settings.authenticates_no_one
    assert not settings.server.allow_unauthenticated
