"""The tenants section: defaults, the demo tenant, and every violation exactly as the operator sees it
(secrets redacted)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config.load import _describe
from gateway.limits.base import TenantLimits
from gateway.tenants import (
    ANONYMOUS_TENANT,
    AuthSettings,
    TenantSettings,
    TenantsSettings,
    class_violations,
    demo_tenants,
    hash_api_key,
)

KEY_A = hash_api_key("key-a")
KEY_B = hash_api_key("key-b")
PLAINTEXT = (
    "looks like a plaintext API key; only hashes are stored: run `sluice hash-key` and put the "
    "sha256:<64 hex digits> it prints here instead (got <redacted>)"
)
NAME_PATTERN = r"'^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'"


def problems(data: dict[str, Any]) -> list[str]:
    """The lines `sluice check-config` prints for ``data`` as the tenants section."""
    with pytest.raises(ValidationError) as caught:
        TenantsSettings.model_validate(data)
    return [line for error in caught.value.errors() for line in _describe(error)]


def test_defaults_have_no_tenant_and_require_no_key() -> None:
    settings = TenantsSettings()
    assert (settings.tenants, settings.keys_file, settings.auth_required) == ({}, None, False)
    tenant = TenantSettings()
    assert (tenant.api_keys, tenant.weight, tenant.default_class, tenant.allowed_classes) == (
        [],
        1.0,
        None,
        None,
    )
    assert tenant.limits.to_limits() == TenantLimits()


def test_a_full_tenant_entry() -> None:
    settings = TenantsSettings.model_validate(
        {
            "auth": {"admin_token_hash": KEY_B.upper().replace("SHA256:", "sha256:")},
            "tenants": {
                "team-a": {
                    "api_keys": [KEY_A],
                    "weight": 2,
                    "limits": {"tokens_per_minute": 1000, "max_concurrent": 4},
                    "default_class": "batch",
                    "allowed_classes": ["batch", "interactive"],
                }
            },
        }
    )
    tenant = settings.tenants["team-a"]
    assert (tenant.api_keys, tenant.weight, tenant.limits.max_concurrent) == ([KEY_A], 2.0, 4)
    assert settings.auth.admin_token_hash == KEY_B  # hex digits canonicalised to lower case


@pytest.mark.parametrize(
    ("auth", "tenants", "required"),
    [
        pytest.param({}, {}, False, id="no-tenants-open"),
        pytest.param({}, {"a": {}}, True, id="a-tenant-requires-keys"),
        pytest.param({"anonymous_tenant": "a"}, {"a": {}}, False, id="anonymous-tenant-opens"),
        pytest.param({"required": False}, {"a": {}}, False, id="explicitly-open"),
        pytest.param({"required": True}, {"a": {}}, True, id="explicitly-closed"),
    ],
)
def test_whether_keys_are_required(auth: dict[str, Any], tenants: dict[str, Any], required: bool) -> None:
    assert TenantsSettings.model_validate({"auth": auth, "tenants": tenants}).auth_required is required


def test_demo_tenant_has_key_sk_demo_and_generous_limits() -> None:
    settings = demo_tenants()
    demo = settings.tenants["demo"]
    assert demo.api_keys == ["sha256:f77894fdfa58e447c57e077eaa9708e8e009c84dc6aba2db80461275e9b85be7"]
    assert settings.auth_required
    limits = demo.limits.to_limits()
    assert limits.tokens_per_minute is not None
    assert limits.tokens_per_minute >= 1_000_000
    assert limits.requests_per_minute is not None
    assert limits.requests_per_minute >= 1000
    assert limits.max_concurrent is not None
    assert limits.max_concurrent >= 64


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(
            {"tenants": {"a": {"api_keys": ["sk-live-1234"]}}},
            [f"tenants.a.api_keys.0: {PLAINTEXT}"],
            id="plaintext-key-refused",
        ),
        pytest.param(
            {"tenants": {"a": {"api_keys": [KEY_A, "sha256:abc", 42]}}},
            [
                "tenants.a.api_keys.1: not a key hash: expected sha256: followed by 64 hex digits "
                "(got <redacted>)",
                "tenants.a.api_keys.2: should be a key hash string (sha256:<64 hex digits>) (got <redacted>)",
            ],
            id="malformed-hashes",
        ),
        pytest.param(
            {"tenants": {"a": {"api_keys": "sk-live-1234"}}},
            ["tenants.a.api_keys: should be a list of key hashes (sha256:<hex>) (got <redacted>)"],
            id="keys-not-a-list",
        ),
        pytest.param(
            {"tenants": {"a": {"api_kyes": ["sk-live-1234"]}}},
            ["tenants.a.api_kyes: unknown key (got <redacted>)"],
            id="misspelt-key-field-redacted",
        ),
        pytest.param(
            {"auth": {"admin_token": "hunter2"}, "tenant": {}},
            [
                "auth.admin_token: unknown key (got <redacted>)",
                "tenant: unknown key; did you mean 'tenants'? (got <redacted>)",
            ],
            id="unknown-keys-redacted",
        ),
        pytest.param(
            {"auth": {"admin_token_hash": "hunter2"}},
            [f"auth.admin_token_hash: {PLAINTEXT}"],
            id="plaintext-admin-token",
        ),
        pytest.param(
            {"tenants": {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B, KEY_A]}}},
            [f"tenants.b.api_keys.1: key hash already used at tenants.a.api_keys.0 (got '{KEY_A}')"],
            id="hash-shared-by-two-tenants",
        ),
        pytest.param(
            {"tenants": {"a": {"api_keys": [KEY_A, KEY_A.upper().replace("SHA256:", "sha256:")]}}},
            [f"tenants.a.api_keys.1: key hash already used at tenants.a.api_keys.0 (got '{KEY_A}')"],
            id="hash-repeated-in-one-tenant",
        ),
        pytest.param(
            {"tenants": {"team a": {}}},
            [f"tenants.team a.[key]: String should match pattern {NAME_PATTERN} (got 'team a')"],
            id="name-not-label-safe",
        ),
        pytest.param(
            {"tenants": {"a": {"weight": 0}}},
            ["tenants.a.weight: Input should be greater than 0 (got 0)"],
            id="weight-zero",
        ),
        pytest.param(
            {"tenants": {"a": {"weight": "2"}}},
            ["tenants.a.weight: Input should be a valid number (got '2')"],
            id="weight-quoted",
        ),
        pytest.param(
            {"tenants": {"a": {"limits": {"token_burst": 5}}}},
            [
                "tenants.a.limits.token_burst: needs tokens_per_minute "
                "(a burst without a rate limits nothing) (got 5.0)"
            ],
            id="tenant-limits-validated",
        ),
        pytest.param(
            {"tenants": {"a": {"default_class": "batch", "allowed_classes": ["interactive"]}}},
            ["tenants.a.default_class: must be one of allowed_classes (interactive) (got 'batch')"],
            id="default-class-not-allowed",
        ),
        pytest.param(
            {"auth": {"anonymous_tenant": "guest"}, "tenants": {"a": {}}},
            ["auth.anonymous_tenant: not a configured tenant (known: a) (got 'guest')"],
            id="anonymous-tenant-unknown",
        ),
        pytest.param(
            {"auth": {"required": True, "anonymous_tenant": "a"}, "tenants": {"a": {}}},
            [
                "auth.required: must not be true when anonymous_tenant is set "
                "(keyless requests would be refused) (got True)"
            ],
            id="required-and-anonymous",
        ),
        pytest.param(
            {"auth": {"required": True}},
            ["auth.required: no tenant is configured, so every request would be refused (got True)"],
            id="required-without-tenants",
        ),
        pytest.param(
            {"tenants": {ANONYMOUS_TENANT: {}}},
            [
                "tenants.anonymous: the name is reserved for keyless requests; set auth.anonymous_tenant: "
                "anonymous to configure that tenant, or choose another name (got 'anonymous')"
            ],
            id="reserved-name",
        ),
        pytest.param(
            {"keys_file": ""},
            ["keys_file: String should have at least 1 character (got '')"],
            id="empty-keys-file-path",
        ),
    ],
)
def test_every_violation_is_reported_exactly(data: dict[str, Any], expected: list[str]) -> None:
    assert problems(data) == expected


def test_anonymous_may_be_configured_as_the_anonymous_tenant() -> None:
    settings = TenantsSettings.model_validate(
        {"auth": {"anonymous_tenant": "anonymous"}, "tenants": {"anonymous": {}}}
    )
    assert not settings.auth_required


def test_no_secret_reaches_the_error_text() -> None:
    data = {
        "auth": {"admin_token_hash": "admin-secret-1", "token": "admin-secret-2"},
        "tenants": {"a": {"api_keys": ["tenant-secret-1"], "key": "tenant-secret-2"}},
    }
    with pytest.raises(ValidationError) as caught:
        TenantsSettings.model_validate(data)
    rendered = [str(caught.value), repr(caught.value), *problems(data)]
    for secret in ("admin-secret-1", "admin-secret-2", "tenant-secret-1", "tenant-secret-2"):
        assert all(secret not in text for text in rendered), secret


def test_hashes_stay_out_of_repr() -> None:
    settings = TenantsSettings.model_validate(
        {"auth": {"admin_token_hash": KEY_B}, "tenants": {"a": {"api_keys": [KEY_A]}}}
    )
    for text in (repr(settings), str(settings), repr(settings.auth), repr(settings.tenants["a"])):
        assert KEY_A[7:] not in text
        assert KEY_B[7:] not in text


def test_tenant_classes_must_be_admission_classes() -> None:
    settings = TenantsSettings.model_validate(
        {"tenants": {"a": {"default_class": "gold"}, "b": {"allowed_classes": ["interactive", "silver"]}}}
    )
    found = class_violations(settings, {"interactive", "batch"}, prefix=("access",))
    assert [(".".join(map(str, v.path)), v.message, v.value) for v in found] == [
        ("access.tenants.a.default_class", "not a configured class (known: batch, interactive)", "gold"),
        (
            "access.tenants.b.allowed_classes.1",
            "not a configured class (known: batch, interactive)",
            "silver",
        ),
    ]
    assert class_violations(demo_tenants(), {"interactive"}) == []


def test_auth_settings_alone() -> None:
    assert AuthSettings().model_dump() == {
        "required": None,
        "anonymous_tenant": None,
        "admin_token_hash": None,
    }
