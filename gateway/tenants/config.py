"""YAML sections for tenants: who they are, their API key hashes, fair-share weight, budgets, classes.

Mounted by ``gateway.config.settings`` under ``tenants:`` (``auth``, ``keys_file``, ``tenants``; every key
is documented in ``config/sluice.example.yaml`` and docs/tenants.md). Only ``sha256:`` key hashes
are accepted: a plaintext key is refused with how to hash it, every value that might be a secret
is shown as ``<redacted>`` in errors, and hashes are left out of ``repr``. ``class_violations``
checks the cross-section rule (tenant classes must be configured admission classes).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any, Final

from pydantic import ConfigDict, Field, field_validator, model_validator

from gateway.config.section import Name, Section, SettingsViolations, Violation
from gateway.limits.config import TenantLimitSettings
from gateway.tenants.keys import REDACTED, hash_api_key, key_hash_problem, normalise_key_hash

__all__ = [
    "ANONYMOUS_TENANT",
    "DEMO_API_KEY",
    "DEMO_TENANT",
    "AuthSettings",
    "TenantSettings",
    "TenantsSettings",
    "check_key_hashes",
    "class_violations",
    "demo_tenants",
]

#: The demo tenant's name and API key (documented; never use this key outside a demo).
DEMO_TENANT: Final = "demo"
DEMO_API_KEY: Final = "sk-demo"

#: Tenant of requests without a key when keys are not required and no ``anonymous_tenant`` is set.
ANONYMOUS_TENANT: Final = "anonymous"


class _Redacting(Section):
    """A section whose unknown keys have their values redacted before validation.

    ``extra="forbid"`` still reports each unknown key, but a misspelt ``api_kyes: [sk-...]`` must
    not echo the plaintext key back in the error. ``hide_input_in_errors`` keeps inputs out of
    ``str(ValidationError)`` when a section is validated on its own.
    """

    model_config = ConfigDict(hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _redact_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(key not in cls.model_fields for key in data):
            return {key: value if key in cls.model_fields else REDACTED for key, value in data.items()}
        return data


def check_key_hashes(value: object) -> list[str]:
    """``value`` as a list of canonical key hashes; ``SettingsViolations`` naming every bad entry.

    Bad entries are shown as ``<redacted>``: they may be plaintext keys. Paths are list indexes.
    """
    if not isinstance(value, list):
        raise SettingsViolations([Violation((), "should be a list of key hashes (sha256:<hex>)", REDACTED)])
    found = [
        Violation((index,), problem, REDACTED)
        for index, item in enumerate(value)
        if (problem := key_hash_problem(item)) is not None
    ]
    if found:
        raise SettingsViolations(found)
    return [normalise_key_hash(item) for item in value]


def _check_one_hash(value: object) -> str | None:
    if value is None:
        return None
    problem = key_hash_problem(value)
    if problem is not None:
        raise SettingsViolations([Violation((), problem, REDACTED)])
    assert isinstance(value, str)
    return normalise_key_hash(value)


class AuthSettings(_Redacting):
    """Whether requests must carry an API key, and the admin token."""

    required: Annotated[
        bool | None,
        Field(
            description="Refuse requests without a valid API key (401). null: true when any tenant is "
            "configured, unless anonymous_tenant is set."
        ),
    ] = None
    anonymous_tenant: Annotated[
        Name | None,
        Field(
            description="Configured tenant that requests without an Authorization header belong to "
            "(implies required: false). null: such requests are refused when keys are required, else "
            f"belong to the built-in, unlimited tenant '{ANONYMOUS_TENANT}'. A wrong key is always refused."
        ),
    ] = None
    admin_token_hash: Annotated[
        str | None,
        Field(
            repr=False,
            description="sha256:<hex> hash (`sluice hash-key`) of the bearer token that /metrics and admin "
            "endpoints require; null: they are protected by the bind address only.",
        ),
    ] = None

    @field_validator("admin_token_hash", mode="before")
    @classmethod
    def _admin_hash(cls, value: object) -> str | None:
        return _check_one_hash(value)


class TenantSettings(_Redacting):
    """One tenant: its keys, its fair share, its budgets, the classes it may use."""

    api_keys: Annotated[
        list[str],
        Field(
            repr=False,
            description="Hashes (sha256:<hex>, from `sluice hash-key`) of the API keys that identify this "
            "tenant; plaintext keys are refused.",
        ),
    ] = Field(default_factory=list)
    weight: Annotated[
        float,
        Field(
            gt=0,
            allow_inf_nan=False,
            description="Fair-share weight when the fleet is saturated: queued requests are served so that "
            "each tenant's weighted tokens are in proportion to its weight (dimensionless).",
        ),
    ] = 1.0
    limits: Annotated[
        TenantLimitSettings, Field(description="Token, request and concurrency budgets (absent: unlimited).")
    ] = TenantLimitSettings()
    default_class: Annotated[
        Name | None,
        Field(description="Class of this tenant's requests that name none; null: admission.default_class."),
    ] = None
    allowed_classes: Annotated[
        list[Name] | None,
        Field(description="Classes this tenant may ask for by header; null: every configured class."),
    ] = None

    @field_validator("api_keys", mode="before")
    @classmethod
    def _hashes(cls, value: object) -> list[str]:
        return check_key_hashes(value)

    @model_validator(mode="after")
    def _consistent(self) -> TenantSettings:
        found: list[Violation] = []
        allowed = self.allowed_classes
        if self.default_class is not None and allowed is not None and self.default_class not in allowed:
            message = f"must be one of allowed_classes ({', '.join(allowed) or 'none'})"
            found.append(Violation(("default_class",), message, self.default_class))
        if found:
            raise SettingsViolations(found)
        return self


class TenantsSettings(_Redacting):
    """Tenants, their keys, and the authentication policy."""

    auth: Annotated[AuthSettings, Field(description="Whether keys are required; the admin token.")] = (
        AuthSettings()
    )
    keys_file: Annotated[
        str | None,
        Field(
            min_length=1,
            description="YAML file mapping tenant names to lists of more key hashes "
            "(`team-a: [sha256:...]`), read and validated with the configuration (relative paths: from "
            "the configuration file's directory); every tenant named there must be configured here.",
        ),
    ] = None
    # A plain default (pydantic copies it per instance), so the example-file test can print it.
    tenants: Annotated[
        dict[Name, TenantSettings],
        Field(description="Tenants by name (the name appears in metrics and logs)."),
    ] = {}  # noqa: RUF012

    @model_validator(mode="after")
    def _consistent(self) -> TenantsSettings:
        found = [*self._repeated_hashes(), *self._auth_problems(), *self._reserved_name()]
        if found:
            raise SettingsViolations(found)
        return self

    def _repeated_hashes(self) -> list[Violation]:
        """Every use of a key hash after its first, within and across tenants."""
        first: dict[str, str] = {}
        found: list[Violation] = []
        for name, tenant in self.tenants.items():
            for index, key_hash in enumerate(tenant.api_keys):
                where = f"tenants.{name}.api_keys.{index}"
                if key_hash in first:
                    message = f"key hash already used at {first[key_hash]}"
                    found.append(Violation(("tenants", name, "api_keys", index), message, key_hash))
                else:
                    first[key_hash] = where
        return found

    def _auth_problems(self) -> list[Violation]:
        auth, found = self.auth, []
        if auth.anonymous_tenant is not None and auth.anonymous_tenant not in self.tenants:
            message = f"not a configured tenant (known: {', '.join(self.tenants) or 'none'})"
            found.append(Violation(("auth", "anonymous_tenant"), message, auth.anonymous_tenant))
        if auth.required and auth.anonymous_tenant is not None:
            message = "must not be true when anonymous_tenant is set (keyless requests would be refused)"
            found.append(Violation(("auth", "required"), message, True))
        if auth.required and not self.tenants:
            message = "no tenant is configured, so every request would be refused"
            found.append(Violation(("auth", "required"), message, True))
        return found

    def _reserved_name(self) -> list[Violation]:
        if ANONYMOUS_TENANT not in self.tenants or self.auth.anonymous_tenant == ANONYMOUS_TENANT:
            return []
        message = (
            f"the name is reserved for keyless requests; set auth.anonymous_tenant: {ANONYMOUS_TENANT} "
            "to configure that tenant, or choose another name"
        )
        return [Violation(("tenants", ANONYMOUS_TENANT), message, ANONYMOUS_TENANT)]

    @property
    def auth_required(self) -> bool:
        """Whether a request without a key is refused: ``auth.required``, or when unset, whether any
        tenant is configured and no ``anonymous_tenant`` is set."""
        if self.auth.required is not None:
            return self.auth.required
        return bool(self.tenants) and self.auth.anonymous_tenant is None


def class_violations(
    tenants: TenantsSettings, classes: Collection[str], *, prefix: tuple[str | int, ...] = ()
) -> list[Violation]:
    """Tenants' ``default_class`` and ``allowed_classes`` entries that are not in ``classes`` (the
    configured admission classes); paths start with ``prefix`` (where ``tenants`` is mounted)."""
    known = ", ".join(sorted(classes))
    found: list[Violation] = []
    for name, tenant in tenants.tenants.items():
        path = (*prefix, "tenants", name)
        if tenant.default_class is not None and tenant.default_class not in classes:
            message = f"not a configured class (known: {known})"
            found.append(Violation((*path, "default_class"), message, tenant.default_class))
        for index, cls in enumerate(tenant.allowed_classes or ()):
            if cls not in classes:
                message = f"not a configured class (known: {known})"
                found.append(Violation((*path, "allowed_classes", index), message, cls))
    return found


def demo_tenants() -> TenantsSettings:
    """The embedded default's tenants: ``demo``, whose API key is ``sk-demo``, with budgets generous
    enough for the README's examples and a demo load (5 M weighted tokens and 3000 requests per
    minute, 256 concurrent requests). Keys are required (a tenant is configured)."""
    limits = TenantLimitSettings(
        tokens_per_minute=5_000_000.0, requests_per_minute=3000.0, max_concurrent=256
    )
    demo = TenantSettings(api_keys=[hash_api_key(DEMO_API_KEY)], limits=limits)
    return TenantsSettings(tenants={DEMO_TENANT: demo})
