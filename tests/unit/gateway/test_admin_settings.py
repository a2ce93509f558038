"""``admin:``: validation (hashes, plaintext refused and redacted, port clashes, the two token
spellings) and what a reload may change (address restart-only, token hot)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from gateway.config.load import ConfigError, parse_settings
from gateway.config.reload import RESTART_ONLY, keep_restart_only, restart_only_changes
from gateway.tenants import hash_api_key

TOKEN = "sluice-admin-token-0123456789"
TOKEN_HEX = hashlib.sha256(TOKEN.encode()).hexdigest()
REPLICA = {"name": "r0", "url": "http://127.0.0.1:8000"}


def settings_data(admin: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"replicas": [REPLICA], **sections}
    if admin is not None:
        data["admin"] = admin
    return data


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_settings(data, "test.yaml")
    return caught.value.problems


def test_default_serves_admin_on_the_public_listener_without_a_token() -> None:
    settings = parse_settings(settings_data(), "test.yaml")

    assert (settings.admin.host, settings.admin.port, settings.admin.token_sha256) == (
        "127.0.0.1",
        None,
        None,
    )
    assert settings.admin_token_digest() is None


@pytest.mark.parametrize(
    "given",
    [TOKEN_HEX, TOKEN_HEX.upper(), hash_api_key(TOKEN), "sha256:" + TOKEN_HEX.upper()],
    ids=["hex", "upper-hex", "hash-key-output", "prefixed-upper"],
)
def test_token_hash_accepts_hex_and_hash_key_output(given: str) -> None:
    settings = parse_settings(settings_data({"token_sha256": given}), "test.yaml")

    assert settings.admin.token_sha256 == TOKEN_HEX
    assert settings.admin_token_digest() == hashlib.sha256(TOKEN.encode()).digest()
    assert TOKEN_HEX not in repr(settings)


@pytest.mark.parametrize(
    "given",
    [TOKEN, TOKEN_HEX[:-1], TOKEN_HEX + "0", "g" * 64, "md5:" + TOKEN_HEX],
    ids=["plaintext", "63-digits", "65-digits", "not-hex", "other-prefix"],
)
def test_bad_token_hash_is_refused_without_echoing_it(given: str) -> None:
    found = problems(settings_data({"token_sha256": given}))

    assert found == [
        "admin.token_sha256: not a SHA-256 hash (64 hex digits, optionally after sha256:); a plaintext "
        "token is never stored: run `sluice hash-key` and put what it prints here (got <redacted>)"
    ]
    assert given not in "\n".join(found)


def test_token_of_another_type_is_refused_and_redacted() -> None:
    assert problems(settings_data({"token_sha256": 12345678})) == [
        "admin.token_sha256: should be a hex SHA-256 string (got <redacted>)"
    ]


def test_misspelt_key_does_not_echo_a_pasted_token() -> None:
    found = problems(settings_data({"token_sha": TOKEN}))

    assert found == ["admin.token_sha: unknown key; did you mean 'token_sha256'? (got <redacted>)"]


@pytest.mark.parametrize(
    ("server", "admin", "expected"),
    [
        pytest.param(
            {"port": 9000},
            {"port": 9000},
            "admin.port: port already used by server.port (on host '127.0.0.1') (got 9000)",
            id="same-default-host",
        ),
        pytest.param(
            {"host": "0.0.0.0", "port": 9000, "allow_unauthenticated": True},
            {"host": "10.0.0.5", "port": 9000},
            "admin.port: port already used by server.port (on host '0.0.0.0') (got 9000)",
            id="public-wildcard",
        ),
        pytest.param(
            {"host": "10.0.0.5", "port": 9000, "allow_unauthenticated": True},
            {"host": "::", "port": 9000},
            "admin.port: port already used by server.port (on host '10.0.0.5') (got 9000)",
            id="admin-wildcard",
        ),
    ],
)
def test_admin_port_clashing_with_the_public_listener_is_refused(
    server: dict[str, Any], admin: dict[str, Any], expected: str
) -> None:
    assert problems(settings_data(admin, server=server)) == [expected]


def test_admin_port_clashing_with_an_emulator_is_refused() -> None:
    data = {"emulators": [{"name": "emu", "port": 8101}], "admin": {"port": 8101}}

    assert problems(data) == [
        "admin.port: port already used by emulators.0.port (on host '127.0.0.1') (got 8101)"
    ]


@pytest.mark.parametrize(
    ("server", "admin"),
    [
        pytest.param(
            {"host": "10.0.0.5", "port": 9000, "allow_unauthenticated": True},
            {"host": "127.0.0.1", "port": 9000},
            id="other-host",
        ),
        pytest.param({"port": 9000}, {"port": 9001}, id="other-port"),
        pytest.param({"port": 0}, {"port": 0}, id="both-free-ports"),
    ],
)
def test_admin_port_without_clash_is_accepted(server: dict[str, Any], admin: dict[str, Any]) -> None:
    settings = parse_settings(settings_data(admin, server=server), "test.yaml")

    assert settings.admin.port == admin["port"]


def test_admin_port_out_of_range_is_refused() -> None:
    assert problems(settings_data({"port": 70000})) == [
        "admin.port: Input should be less than or equal to 65535 (got 70000)"
    ]


def test_older_admin_token_hash_is_the_same_token() -> None:
    data = settings_data(tenants={"auth": {"admin_token_hash": hash_api_key(TOKEN)}})

    assert parse_settings(data, "test.yaml").admin_token_digest() == hashlib.sha256(TOKEN.encode()).digest()
    # Both spellings of one token: accepted.
    both = {**data, "admin": {"token_sha256": TOKEN_HEX}}
    assert parse_settings(both, "test.yaml").admin_token_digest() == hashlib.sha256(TOKEN.encode()).digest()


def test_two_different_admin_tokens_are_refused() -> None:
    data = settings_data(
        {"token_sha256": TOKEN_HEX}, tenants={"auth": {"admin_token_hash": hash_api_key("another-token")}}
    )

    assert problems(data) == [
        "admin.token_sha256: differs from tenants.auth.admin_token_hash; both name the one admin token: "
        "set only one (got <redacted>)"
    ]


def test_admin_token_that_is_a_tenant_key_is_refused() -> None:
    tenants = {"tenants": {"team-a": {"api_keys": [hash_api_key(TOKEN)]}}}

    assert problems(settings_data({"token_sha256": TOKEN_HEX}, tenants=tenants)) == [
        "admin.token_sha256: is also a tenant's API key; the admin token must be a secret of its own "
        "(got <redacted>)"
    ]


# -- reload ------------------------------------------------------------------------------------------


def test_admin_address_is_restart_only_and_the_token_is_not() -> None:
    old = parse_settings(settings_data({"port": 9100}), "old.yaml")
    new = parse_settings(
        settings_data({"host": "0.0.0.0", "port": 9200, "token_sha256": TOKEN_HEX}), "new.yaml"
    )

    assert {"admin.host", "admin.port"} <= set(RESTART_ONLY)
    assert restart_only_changes(old, new) == ["admin.host", "admin.port"]
    kept = keep_restart_only(old, new)
    assert (kept.admin.host, kept.admin.port) == ("127.0.0.1", 9100)
    assert kept.admin.token_sha256 == TOKEN_HEX
