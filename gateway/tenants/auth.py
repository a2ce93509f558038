"""Who is calling: the ``Authorization: Bearer <key>`` header to a tenant, or a typed 401.

``Authenticator`` is built from a validated ``TenantsSettings`` snapshot (rebuilt on reload).
``authenticate`` returns the ``Tenant`` the key belongs to or an ``AuthError`` value (mapped to a
401 by the one HTTP-mapping module); the key alone names the tenant. Keys are matched by their
SHA-256 digest in a dict, which leaks nothing useful by timing (docs/tenants.md says why); the
admin token is compared with ``hmac.compare_digest``. Nothing here logs, and no ``repr`` or
error message shows a key or its hash.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, ClassVar, Final

from gateway.limits.base import TenantLimits
from gateway.tenants.config import ANONYMOUS_TENANT, TenantSettings, TenantsSettings
from gateway.tenants.keys import hash_digest, is_valid_key, key_digest

__all__ = ["AuthError", "AuthFailure", "Authenticator", "Tenant"]

_BEARER: Final = "bearer"
_UNLIMITED: Final = TenantLimits()


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant as the request pipeline uses it (no key material).

    ``weight``: fair-share weight (> 0). ``limits``: budgets for the limiter. ``default_class``:
    class of requests that name none (``None``: the admission default). ``allowed_classes``:
    classes it may ask for by header (``None``: every class), for ``admission.choose_class``.
    """

    name: str
    weight: float = 1.0
    limits: TenantLimits = _UNLIMITED
    default_class: str | None = None
    allowed_classes: frozenset[str] | None = None

    @classmethod
    def from_settings(cls, name: str, settings: TenantSettings) -> Tenant:
        """The tenant ``name`` as configured by ``settings``."""
        allowed = None if settings.allowed_classes is None else frozenset(settings.allowed_classes)
        return cls(name, settings.weight, settings.limits.to_limits(), settings.default_class, allowed)


class AuthFailure(StrEnum):
    """Why a request was not authenticated. Bounded: safe as a metric label."""

    MISSING = "missing"  # no Authorization header (or an empty one) where a key is required
    MALFORMED = "malformed"  # not `Bearer <key>`, or the key holds characters no key can have
    UNKNOWN = "unknown"  # a well-formed key that belongs to no tenant


_MESSAGES: Final = {
    AuthFailure.MISSING: "You didn't provide an API key. You need to provide your API key in an "
    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    AuthFailure.MALFORMED: "Malformed Authorization header: expected 'Bearer YOUR_KEY', the key being "
    "one word of visible ASCII characters.",
    AuthFailure.UNKNOWN: "Incorrect API key provided. Check the key, or ask your Sluice operator for one.",
}


@dataclass(frozen=True, slots=True)
class AuthError:
    """A request that is not authenticated: HTTP 401, OpenAI ``type`` ``invalid_request_error``,
    ``code`` ``invalid_api_key`` (what OpenAI's API answers, and what its SDKs turn into
    ``AuthenticationError``). ``reason`` says which case, for metrics and logs."""

    status: ClassVar[int] = 401
    error_type: ClassVar[str] = "invalid_request_error"
    code: ClassVar[str] = "invalid_api_key"

    reason: AuthFailure

    @property
    def message(self) -> str:
        """The client-facing message (never contains the key)."""
        return _MESSAGES[self.reason]

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error object, ready for ``json.dumps``."""
        return {"error": {"message": self.message, "type": self.error_type, "param": None, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``WWW-Authenticate`` as RFC 6750 asks of a 401 (``invalid_token`` when a key was sent)."""
        if self.reason is AuthFailure.MISSING:
            return {"WWW-Authenticate": 'Bearer realm="sluice"'}
        return {"WWW-Authenticate": 'Bearer realm="sluice", error="invalid_token"'}


class Authenticator:
    """API keys to tenants, from one settings snapshot (immutable; build a new one on reload).

    Building hashes nothing (the settings hold digests already): O(keys). ``issued``: more keys,
    hash -> tenant name, from the key store (those of tenants not configured are ignored);
    ``revoked``: hashes of ``settings``' keys that no longer open anything.
    """

    def __init__(
        self,
        settings: TenantsSettings,
        *,
        issued: Mapping[str, str] | None = None,
        revoked: frozenset[str] = frozenset(),
    ) -> None:
        tenants = {name: Tenant.from_settings(name, t) for name, t in settings.tenants.items()}
        self._tenants: Mapping[str, Tenant] = MappingProxyType(tenants)
        self._by_digest: dict[bytes, Tenant] = {
            hash_digest(key_hash): tenants[name]
            for name, tenant in settings.tenants.items()
            for key_hash in tenant.api_keys
            if key_hash not in revoked
        }
        for key_hash, name in (issued or {}).items():
            if name in tenants:
                self._by_digest[hash_digest(key_hash)] = tenants[name]
        self._required = settings.auth_required
        anonymous = settings.auth.anonymous_tenant
        self._anonymous = tenants[anonymous] if anonymous is not None else Tenant(ANONYMOUS_TENANT)
        admin = settings.auth.admin_token_hash
        self._admin: bytes | None = None if admin is None else hash_digest(admin)

    def __repr__(self) -> str:
        return (
            f"Authenticator({len(self._tenants)} tenants, {len(self._by_digest)} keys, "
            f"required={self._required}, admin_token={self._admin is not None})"
        )

    @property
    def required(self) -> bool:
        """Whether requests without a key are refused."""
        return self._required

    @property
    def tenants(self) -> Mapping[str, Tenant]:
        """Configured tenants by name (read-only)."""
        return self._tenants

    @property
    def anonymous(self) -> Tenant | None:
        """The tenant of keyless requests; ``None`` when keys are required."""
        return None if self._required else self._anonymous

    def authenticate(self, authorization: str | None) -> Tenant | AuthError:
        """The tenant whose key is in ``authorization`` (the raw header value; ``None``: absent).

        Absent or blank: the anonymous tenant when keys are not required, else ``MISSING``. Not
        ``Bearer <key>`` (scheme case-insensitive): ``MALFORMED``. A key that belongs to no tenant:
        ``UNKNOWN``, even when keys are not required (a wrong key is a client bug worth hearing of).
        O(len(key)).
        """
        if authorization is None or not authorization.strip():
            return AuthError(AuthFailure.MISSING) if self._required else self._anonymous
        key = bearer_token(authorization)
        if key is None:
            return AuthError(AuthFailure.MALFORMED)
        tenant = self._by_digest.get(key_digest(key))
        return tenant if tenant is not None else AuthError(AuthFailure.UNKNOWN)

    def admin_allowed(self, authorization: str | None) -> bool:
        """Whether a request to ``/metrics`` or an admin endpoint may proceed: always when no
        ``auth.admin_token_hash`` is configured, else only with ``Bearer <that token>``."""
        if self._admin is None:
            return True
        key = None if authorization is None else bearer_token(authorization)
        if key is None:
            return False
        return hmac.compare_digest(key_digest(key), self._admin)


def bearer_token(authorization: str) -> str | None:
    """The key in ``Bearer <key>`` (scheme in any case, surrounding spaces ignored); ``None`` when
    the value has another shape or the key holds characters no key can have."""
    scheme, _, rest = authorization.strip().partition(" ")
    key = rest.strip()
    if scheme.lower() != _BEARER or not is_valid_key(key):
        return None
    return key
