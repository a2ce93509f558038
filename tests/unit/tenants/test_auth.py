"""Hashing keys and authenticating requests: every header shape, the tenant from the key alone, the
admin token, and no key ever shown in a repr, a str, an error or a log."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest

from gateway.limits.base import TenantLimits
from gateway.tenants import (
    ANONYMOUS_TENANT,
    Authenticator,
    AuthError,
    AuthFailure,
    Tenant,
    TenantsSettings,
    bearer_token,
    demo_tenants,
    hash_api_key,
)
from gateway.tenants.keys import REDACTED, key_hash_problem

KEY_A = "sk-team-a-0123456789"
KEY_A2 = "sk-team-a-rotated"
KEY_B = "sk-team-b-abcdef"
ADMIN = "admin-token-xyz"


def settings(auth: dict[str, Any] | None = None) -> TenantsSettings:
    return TenantsSettings.model_validate(
        {
            "auth": auth or {},
            "tenants": {
                "team-a": {
                    "api_keys": [hash_api_key(KEY_A), hash_api_key(KEY_A2)],
                    "weight": 2,
                    "limits": {"requests_per_minute": 60},
                    "default_class": "batch",
                    "allowed_classes": ["batch"],
                },
                "team-b": {"api_keys": [hash_api_key(KEY_B)]},
            },
        }
    )


# --- hashing ------------------------------------------------------------------------------------


def test_hash_is_sha256_hex_of_the_key() -> None:
    assert hash_api_key("sk-demo") == "sha256:" + hashlib.sha256(b"sk-demo").hexdigest()
    assert (
        hash_api_key("sk-demo") == "sha256:f77894fdfa58e447c57e077eaa9708e8e009c84dc6aba2db80461275e9b85be7"
    )
    assert key_hash_problem(hash_api_key("anything")) is None


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("", id="empty"),
        pytest.param("sk has spaces", id="space"),
        pytest.param("sk-\tx", id="tab"),
        pytest.param("sk-é", id="non-ascii"),
    ],
)
def test_a_key_that_cannot_travel_in_a_header_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="visible ASCII") as caught:
        hash_api_key(key)
    assert key == "" or key not in str(caught.value)


def test_redacted_shows_nothing() -> None:
    assert (repr(REDACTED), str(REDACTED), f"{REDACTED}") == ("<redacted>",) * 3


# --- authenticate -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(f"Bearer {KEY_A}", "team-a", id="key-a"),
        pytest.param(f"Bearer {KEY_A2}", "team-a", id="second-key-of-a"),
        pytest.param(f"Bearer {KEY_B}", "team-b", id="key-b"),
        pytest.param(f"bearer {KEY_B}", "team-b", id="scheme-any-case"),
        pytest.param(f"  BEARER   {KEY_B}  ", "team-b", id="surrounding-spaces"),
        pytest.param(None, AuthFailure.MISSING, id="no-header"),
        pytest.param("", AuthFailure.MISSING, id="empty-header"),
        pytest.param("   ", AuthFailure.MISSING, id="blank-header"),
        pytest.param("Bearer", AuthFailure.MALFORMED, id="scheme-only"),
        pytest.param("Bearer ", AuthFailure.MALFORMED, id="scheme-and-space"),
        pytest.param(KEY_A, AuthFailure.MALFORMED, id="key-without-scheme"),
        pytest.param(f"Basic {KEY_A}", AuthFailure.MALFORMED, id="basic-auth"),
        pytest.param(f"Bearer {KEY_A} team-b", AuthFailure.MALFORMED, id="extra-words"),
        pytest.param(f"Bearer {KEY_A}\x00", AuthFailure.MALFORMED, id="control-character"),
        pytest.param("Bearer sk-é", AuthFailure.MALFORMED, id="non-ascii-key"),
        pytest.param("Bearer sk-unknown", AuthFailure.UNKNOWN, id="unknown-key"),
        pytest.param(f"Bearer {KEY_A}x", AuthFailure.UNKNOWN, id="key-plus-a-character"),
        pytest.param(f"Bearer {KEY_A.upper()}", AuthFailure.UNKNOWN, id="keys-are-case-sensitive"),
        pytest.param("Bearer team-a", AuthFailure.UNKNOWN, id="tenant-name-is-not-a-key"),
        pytest.param(f"Bearer {hash_api_key(KEY_A)}", AuthFailure.UNKNOWN, id="the-hash-is-not-the-key"),
    ],
)
def test_authenticate(header: str | None, expected: str | AuthFailure) -> None:
    result = Authenticator(settings()).authenticate(header)
    if isinstance(expected, AuthFailure):
        assert result == AuthError(expected)
    else:
        assert isinstance(result, Tenant)
        assert result.name == expected


def test_the_tenant_carries_its_configuration() -> None:
    tenant = Authenticator(settings()).authenticate(f"Bearer {KEY_A}")
    assert tenant == Tenant(
        "team-a", 2.0, TenantLimits(requests_per_minute=60.0), "batch", frozenset({"batch"})
    )


@pytest.mark.parametrize(
    ("auth", "header", "expected"),
    [
        pytest.param({"required": False}, None, ANONYMOUS_TENANT, id="open-no-key-builtin-anonymous"),
        pytest.param({"anonymous_tenant": "team-b"}, None, "team-b", id="no-key-configured-anonymous"),
        pytest.param({"anonymous_tenant": "team-b"}, f"Bearer {KEY_A}", "team-a", id="open-key-still-counts"),
        pytest.param({"anonymous_tenant": "team-b"}, "Bearer nope", AuthFailure.UNKNOWN, id="open-wrong-key"),
        pytest.param({"required": False}, "Token x", AuthFailure.MALFORMED, id="open-malformed"),
        pytest.param({}, None, AuthFailure.MISSING, id="required-by-default"),
    ],
)
def test_keyless_requests(auth: dict[str, Any], header: str | None, expected: str | AuthFailure) -> None:
    result = Authenticator(settings(auth)).authenticate(header)
    if isinstance(expected, AuthFailure):
        assert result == AuthError(expected)
    else:
        assert isinstance(result, Tenant)
        assert result.name == expected


def test_no_tenants_configured_means_everyone_is_anonymous() -> None:
    auth = Authenticator(TenantsSettings())
    assert not auth.required
    assert auth.authenticate(None) == Tenant(ANONYMOUS_TENANT)
    assert auth.anonymous == Tenant(ANONYMOUS_TENANT)
    assert auth.authenticate("Bearer sk-anything") == AuthError(AuthFailure.UNKNOWN)


def test_demo_key_authenticates_as_the_demo_tenant() -> None:
    tenant = Authenticator(demo_tenants()).authenticate("Bearer sk-demo")
    assert isinstance(tenant, Tenant)
    assert tenant.name == "demo"


def test_only_the_authorization_header_is_read() -> None:
    # The API takes the Authorization value and nothing else: no tenant header, no body field.
    import inspect

    assert list(inspect.signature(Authenticator.authenticate).parameters) == ["self", "authorization"]


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        pytest.param(AuthFailure.MISSING, "You didn't provide an API key.", id="missing"),
        pytest.param(AuthFailure.MALFORMED, "Malformed Authorization header", id="malformed"),
        pytest.param(AuthFailure.UNKNOWN, "Incorrect API key provided.", id="unknown"),
    ],
)
def test_errors_are_openai_style_401s(reason: AuthFailure, message: str) -> None:
    error = AuthError(reason)
    body = error.body()
    assert error.status == 401
    assert body["error"]["message"].startswith(message)
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        None,
    )
    assert error.headers()["WWW-Authenticate"].startswith('Bearer realm="sluice"')


# --- the admin token ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "header", "allowed"),
    [
        pytest.param(False, None, True, id="no-token-configured"),
        pytest.param(True, f"Bearer {ADMIN}", True, id="right-token"),
        pytest.param(True, None, False, id="no-header"),
        pytest.param(True, "Bearer wrong", False, id="wrong-token"),
        pytest.param(True, f"Bearer {KEY_A}", False, id="a-tenant-key-is-not-admin"),
        pytest.param(True, ADMIN, False, id="no-scheme"),
    ],
)
def test_admin_token(configured: bool, header: str | None, allowed: bool) -> None:
    auth = {"admin_token_hash": hash_api_key(ADMIN)} if configured else {}
    assert Authenticator(settings(auth)).admin_allowed(header) is allowed


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("Bearer a b") is None


# --- secrets never shown ------------------------------------------------------------------------


def test_keys_never_appear_in_repr_str_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secrets = (KEY_A, KEY_A2, KEY_B, ADMIN)
    config = settings({"admin_token_hash": hash_api_key(ADMIN)})
    auth = Authenticator(config)
    shown: list[str] = [repr(auth), str(auth), repr(config), str(config)]
    for header in (f"Bearer {KEY_A}", f"Bearer {KEY_B}x", f"Basic {KEY_A2}", None, f"Bearer {ADMIN}"):
        result = auth.authenticate(header)
        shown += [repr(result), str(result)]
        if isinstance(result, AuthError):
            shown += [str(result.body()), str(result.headers())]
        logging.getLogger("sluice.test").info("authenticated %r via %s", result, auth)
    auth.admin_allowed(f"Bearer {ADMIN}")
    shown.append(caplog.text)
    hashes = [hash_api_key(s)[7:] for s in secrets]
    for text in shown:
        for secret in (*secrets, *hashes):
            assert secret not in text, (secret, text)
